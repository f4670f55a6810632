"""The offline tools, on top of the library: they read logs and run the demo, nothing runs them.

    cli.py            the ``kvledger`` console script: a lazy registry of subcommands
    replay.py         ``kvledger replay``: fold a log, checked or trusted (replay_report.py: the summary;
                      replay_cli.py: the command line)
    audit/            ``kvledger audit``: page, request and snapshot lifecycles, steps per rank,
                      lifecycle faults, SVG

The demo (``kvledger demo``) has its own room, ``kvledger.demo``. Importing a
tool never imports torch.
"""
