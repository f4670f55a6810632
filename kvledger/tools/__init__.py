"""The offline tools, on top of the library: they read logs and run the demo, nothing runs them.

    cli.py      the ``kvledger`` console script: a lazy registry of subcommands
    replay.py   ``kvledger replay``: fold a log with every check on
    audit/      ``kvledger audit``: page, request and snapshot lifecycles, lifecycle faults, SVG

The demo (``kvledger demo``) has its own room, ``kvledger.demo``. Importing a
tool never imports torch.
"""
