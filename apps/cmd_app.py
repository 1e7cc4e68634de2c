"""`meshplan app`: start the Streamlit explorer (`apps/streamlit_app.py`) on this machine.

    meshplan app                 # http://127.0.0.1:8501
    meshplan app --port 8600 --address 0.0.0.0
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

APP_PATH = Path(__file__).resolve().with_name("streamlit_app.py")


def streamlit_command(port: int = 8501, address: str = "127.0.0.1",
                      headless: bool = True) -> list[str]:
    """The ``streamlit run`` command line that serves the explorer.

    >>> cmd = streamlit_command(8600)
    >>> cmd[3], Path(cmd[4]).name, cmd[cmd.index("--server.port") + 1]
    ('run', 'streamlit_app.py', '8600')
    """
    return [sys.executable, "-m", "streamlit", "run", str(APP_PATH),
            "--server.port", str(port), "--server.address", address,
            "--server.headless", "true" if headless else "false",
            "--browser.gatherUsageStats", "false", "--client.toolbarMode", "minimal"]


def cmd_app(args: argparse.Namespace) -> int:
    """Become the streamlit server (exec): signals sent to `meshplan app` reach it directly,
    so stopping the command never leaves an orphan server behind."""
    from planner.spec import PlanError
    if not 1 <= args.port <= 65535:
        raise PlanError(f"--port={args.port} must be a TCP port in 1..65535 (default 8501)")
    print(f"meshplan explorer on http://{args.address}:{args.port} (Ctrl-C stops it)",
          file=sys.stderr, flush=True)
    command = streamlit_command(args.port, args.address, not args.browser)
    os.execv(command[0], command)
    return 0  # not reached: execv replaces this process


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``app`` subcommand on ``sub`` (the CLI's subparsers)."""
    sa = sub.add_parser("app", help="start the Streamlit explorer in a browser")
    sa.add_argument("--port", type=int, default=8501, help="port to serve on (default 8501)")
    sa.add_argument("--address", default="127.0.0.1",
                    help="address to bind (default 127.0.0.1; 0.0.0.0 for every interface)")
    sa.add_argument("--browser", action="store_true", help="also open a local browser")
    sa.set_defaults(func=cmd_app)
