"""The command line (``structinit …``): :mod:`structinit.harness.cli.main` parses and
dispatches; each command that is not ``train`` or ``compare`` is a module here."""
