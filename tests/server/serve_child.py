"""``mambaradix serve`` in a child process, optionally with an injected engine fault: a
forward whose batch holds a prompt starting with FAULT_PROMPT raises (a fault of the engine
itself, not of one request). Run as ``python serve_child.py [--fault] <serve flags>``."""

from __future__ import annotations

import sys

FAULT_PROMPT = [13, 17, 13, 17, 13]


def main() -> int:
    args = sys.argv[1:]
    if args and args[0] == "--fault":
        args = args[1:]
        from mambaradix.engine import runner

        real = runner.ModelRunner.run

        def run(self, batch):
            if any(r.input_ids[:5] == FAULT_PROMPT for r in batch.forward.reqs):
                raise RuntimeError("injected forward fault")
            return real(self, batch)

        runner.ModelRunner.run = run
    from mambaradix.cli import main as cli_main

    return cli_main(["serve", *args])


if __name__ == "__main__":
    sys.exit(main())
