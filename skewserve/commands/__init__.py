"""The `skewserve` command line: one module per command group, each a thin layer over a library call.

`main.py` assembles the app; `options.py` and `foreground.py` hold what several commands share.
"""
