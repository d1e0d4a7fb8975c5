"""Position the forward reads from tables rather than adds one row per token: a table resized to
the call's grid (SigLIP-2's), rows gathered at position ids from a larger table (Hunyuan-VL's),
a row table and a column table summed (Pix2Struct's). How the tokens read the tables is measured
off the forward (one linear map, the same on every channel); impulse writes the tables so that
the tokens read its design, and the layers' own softmax maps on what the model reads show it."""

import pytest
import torch
from attention_styles import RawLinearAttention
from hypothesis import given, settings
from hypothesis import strategies as st
from layout_models import TableViT
from torch import nn

import structinit
from rejection import check_rejected
from structinit.adapters.survey import ModelSurvey


def _own_hits(model: TableViT, layer: int) -> torch.Tensor:
    """Per head, the share of grid rows whose argmax in layer ``layer``'s own map is the token at
    its offset, on the position rows the model's own embedding reads (the block's norm of them);
    rows whose target is off the 8×8 grid are not counted."""
    with torch.no_grad():
        attn = model.attns[layer]
        attn(model.norms[layer](model.embeddings.positions(8, 8)[None]))
        probs = attn.last_probs[0]  # (heads, 64, 64), as the module computed them
    hits = []
    for h, (dy, dx) in enumerate(attn.structinit_impulse["offsets"]):
        got = [int(probs[h, y * 8 + x].argmax()) == (y + dy) * 8 + x + dx
               for y in range(8) for x in range(8) if 0 <= y + dy < 8 and 0 <= x + dx < 8]
        hits.append(sum(got) / len(got))
    return torch.tensor(hits)


@pytest.mark.parametrize("read", ["resize", "gather", "rows-and-columns"])
def test_impulse_on_a_table_the_tokens_read_through_a_map_hits_in_the_layers_own_maps(read):
    torch.manual_seed(0)
    model = TableViT(read)
    found = ModelSurvey(model).position
    assert found.pos_embed is model.embeddings.table.weight and found.grid == (8, 8)
    tables = [model.embeddings.table.weight] + ([] if read != "rows-and-columns" else [model.embeddings.columns.weight])
    assert [t for _, t in found.pos_tables] == tables[1:]
    assert found.pos_reader is not None and tuple(found.pos_reader.shape) == (64, sum(len(t) for t in tables))
    before = [t.detach().clone() for t in tables]
    structinit.init_(model, "impulse", seed=0, reserve="none")
    for layer in range(2):
        assert (_own_hits(model, layer) == 1).all(), layer
    assert (structinit.impulse_fidelity(model)["hit"] == 1).all()
    changed = [(t != b).any(1) for t, b in zip(tables, before)]
    if read == "gather":  # the least change: the 64 rows the grid reads, and no other
        ids = 1 + (torch.arange(8)[:, None] * 16 + torch.arange(8)).flatten()
        assert changed[0][ids].all() and int(changed[0].sum()) == 64
    if read == "rows-and-columns":  # rows 1 … 8 of each table, the grid's, and no other
        assert all(c[1:9].all() and int(c.sum()) == 8 for c in changed)
    # Broken on purpose: one head's q replaced by a random one; its own maps and the fidelity miss
    with torch.no_grad():
        model.attns[0].w_in[:16] = torch.randn(16, 48, generator=torch.Generator().manual_seed(1))
    assert _own_hits(model, 0)[0] < 0.5 and structinit.impulse_fidelity(model)["hit"][0, 0] < 0.5


def test_a_table_whose_rows_several_grid_tokens_read_alike_is_refused_and_left_unchanged():
    torch.manual_seed(0)
    model = TableViT("clamped")  # the grid's last two columns read one row
    check_rejected(model, lambda m: structinit.init_(m, "impulse", seed=0, reserve="none"), ValueError,
                   r"position table `embeddings\.table\.weight` is read so that the 64 grid tokens "
                   r"cannot get the rows impulse designs.*pe_scale=None")


def test_a_table_resized_up_to_the_grid_is_refused_for_its_rows_and_left_unchanged():
    """A 6×6 table resized to the 8×8 grid: 36 rows cannot give 64 tokens 64 designed rows."""
    torch.manual_seed(0)
    check_rejected(TableViT("resize", side=6), lambda m: structinit.init_(m, "impulse", seed=0, reserve="none"),
                   ValueError, r"cannot get the rows impulse designs \(their 64 rows are read from 36 table rows, as "
                   r"a table resized up to the grid is\).*pe_scale=None")


class _Read(nn.Module):
    """Tokens = patch content + ``read`` (T × R) @ table (R × D), or through a nonlinearity, or
    with the table's channels mixed; then one attention layer."""

    def __init__(self, read: torch.Tensor, width: int, how: str):
        super().__init__()
        self.how, self.first = how, read.shape[1] // 2 if how == "two tables" else read.shape[1]
        self.register_buffer("read", read)
        self.table = nn.Parameter(torch.randn(self.first, width))
        self.table2 = nn.Parameter(torch.randn(read.shape[1] - self.first, width))  # a column table beside a row one
        self.mix = nn.Parameter(torch.randn(width, width))
        self.content = nn.Linear(3, width)

    def forward(self, x):
        rows = self.read[:, :self.first] @ self.table + self.read[:, self.first:] @ self.table2
        rows = torch.tanh(rows) if self.how == "tanh" else rows @ self.mix if self.how == "mixed" else rows
        return self.content(x) + rows


class _ReadThenAttend(nn.Module):
    def __init__(self, read, width, how):
        super().__init__()
        self.embeddings = _Read(read, width, how)
        self.attn = RawLinearAttention(width, 2)

    def forward(self, x):
        return self.attn(self.embeddings(x))


@given(tokens=st.integers(4, 40), rows=st.integers(4, 30), density=st.floats(0.05, 1.0), seed=st.integers(0, 999))
@settings(max_examples=40, deadline=None)
def test_the_reading_of_a_table_is_the_map_the_forward_applies(tokens, rows, density, seed):
    """Any linear read of a table, or of two summed, the same on every channel (more tokens than
    channels, so it takes several backwards), is recovered; a read through a nonlinearity or one
    that mixes the table's channels is none."""
    from structinit.adapters.trace import table_reader

    gen = torch.Generator().manual_seed(seed)
    read = torch.randn(tokens, rows, generator=gen) * (torch.rand(tokens, rows, generator=gen) < density)
    read[torch.arange(tokens), torch.randint(0, rows, (tokens,), generator=gen)] = 1.0  # every token reads a row
    inputs = torch.randn(2, tokens, 3, generator=gen)
    width = 8
    for how in ("linear", "two tables", "tanh", "mixed"):
        torch.manual_seed(seed)
        model = _ReadThenAttend(read, width, how)
        tables = [("embeddings.table", model.embeddings.table)]
        tables += [("embeddings.table2", model.embeddings.table2)] if how == "two tables" else []
        before = [t.detach().clone() for _, t in tables]
        found = table_reader(model, inputs, tables, "attn", tokens)
        assert all(torch.equal(t, b) for (_, t), b in zip(tables, before))  # the probe's change is undone bit for bit
        if how not in ("linear", "two tables"):
            assert found is None, how
            continue
        assert found is not None and torch.allclose(found, read.double(), atol=1e-5)


def test_a_named_embedding_the_forward_resizes_to_the_images_grid_is_read_on_the_probe():
    """timm's finder names the table and its own 16×16 grid, but the layers receive the 8×8 grid of
    the images the model states: the layout is read again on those images, through the resize,
    and impulse hits in the layers' own maps of what they read."""
    from layout_models import ResizedTableViT

    torch.manual_seed(0)
    model = ResizedTableViT()
    found = ModelSurvey(model).position
    assert found.grid == (8, 8) and tuple(found.pos_reader.shape) == (64, 256)
    structinit.init_(model, "impulse", seed=0, reserve="none")
    with torch.no_grad():
        for layer, attn in enumerate(model.attns):
            attn(model.norms[layer](model.positions(8, 8)[None]))
            arg = attn.last_probs[0].argmax(-1)
            for h, (dy, dx) in enumerate(attn.structinit_impulse["offsets"]):
                cells = [(y, x) for y in range(8) for x in range(8) if 0 <= y + dy < 8 and 0 <= x + dx < 8]
                assert all(int(arg[h, y * 8 + x]) == (y + dy) * 8 + x + dx for y, x in cells), (layer, h)
