// Counts the images the browser decoded (naturalWidth > 0) once everything has loaded: the
// browser test reads it back from the DOM next to the data-images-total the page was written with.
window.addEventListener("load", function () {
  var images = document.images, decoded = 0;
  for (var i = 0; i < images.length; i++) {
    if (images[i].complete && images[i].naturalWidth > 0) { decoded++; }
  }
  document.body.dataset.imagesDecoded = String(decoded);
});
