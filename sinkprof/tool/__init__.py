"""The tool on top of the library: the case matrix, the launcher, the output path, the error map
and the commands (check, bench, emulate, report, doctor, profiles). Nothing in the library
imports this package (``tests/test_layering.py``; docs/design.md, section 9)."""
