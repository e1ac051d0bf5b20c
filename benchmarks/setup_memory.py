"""Setup memory (issues 44, 55): what setting up a big model adds to each rank's resident memory, built whole vs on
meta, and then two training steps of every cell (a layout that sets up and fails at its first step proves nothing).

    python benchmarks/setup_memory.py                # the issue's run: a 2.64 GB fp32 Qwen2, 6 cells (2 cores)
    python benchmarks/setup_memory.py --cells today,sharded,tensor,pipeline,pp2xtp2,dp2xtp2-full,sharded-init,today-dp
    python benchmarks/setup_memory.py --hidden 256 --heads 4 --intermediate 512 --layers 4 --cells today,tensor \
        --out /tmp/s.json   # smoke (~2 min)
    python benchmarks/setup_memory.py --checkpoint /tmp/qwen2-1.9g   # keep (and reuse) the written checkpoint

The launching process builds a ``transformers`` ``Qwen2ForCausalLM`` from a ``Qwen2Config`` of Qwen2.5-1.5B's width
(hidden 1536, 12 query heads, 2 key/value heads: fewer than the 4 tensor-parallel ranks, MLP 8960; 12 layers,
vocabulary 32000, an untied head; ``--hidden``/``--heads``/``--kv-heads``/``--intermediate``/``--layers``/
``--tied``), writes it
with ``save_pretrained`` and frees it. Each cell is then one job
of 4 ranks (Lightning's launcher, gloo on 127.0.0.1, one thread each, ``Trainer(accelerator="cpu", devices=4)``),
one cell after another, each in its own session with a hard timeout (``harness.run_reaped``). On every rank:

1. everything heavy is imported first (torch, Lightning, the Llama modules, the plugin, ``torch._dynamo``,
   ``torch._inductor``, DCP, DTensor, pipelining: what setup would otherwise import), and the Trainer is made;
2. the peak is reset (``/proc/self/clear_refs`` <- ``5``: ``VmHWM`` becomes the current ``VmRSS``) and ``VmRSS`` is
   read: the baseline;
3. the model is built as the cell says: **today's path** ``LlamaForCausalLM.from_pretrained(folder)`` in the
   LightningModule (real weights on every rank; the strategy broadcasts rank 0's, then splits), or **on meta**
   (``with trainer.init_module(empty_init=True)``, ``SGDTPStrategy(pretrained=folder, ...)``: split on meta, each
   rank allocates its part and reads it by shard);
4. ``trainer.fit``; a callback's ``on_fit_start`` (right after the strategy's setup, before any step) reads
   ``VmHWM``: the setup figure. Then two training steps (AdamW) run; at ``on_train_end`` every parameter this rank
   holds (its shards, its stages) must be finite and the losses too, and every rank's figures are gathered to rank 0
   (both steps ran and compiled: checked).

The measure: ``(VmHWM - baseline VmRSS) / model bytes`` per rank (model bytes: the fp32 parameters). A sampling
thread (every 20 ms) also records the highest ``RssAnon`` (memory the process owns, file pages excluded), a
second, sampled view of the same peak. ``SETUP_MEMORY_DEBUG=1`` records the timeline (RssAnon / RssFile at each
sample and the setup hooks) in each rank's JSON, to see where memory goes.

Criterion (issues 44, 55): every meta cell's fullest rank <= 0.35 of the model's bytes at setup; today's path >= 1.0
on every rank (and its rank-0 line says so, with the fix); every cell trains 2 steps with finite parameters and
losses. FAIL lines and exit code 1 otherwise (or when a cell fails). The JSON (machine, model, bytes, per-rank
figures) goes to ``--out`` (default ``benchmarks/results/setup_memory_<date>.json``) and is printed as the last line.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import re
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve()
sys.path.insert(0, str(REPO / "benchmarks"))

from harness import QUIET_TRAINER, fmt, frames_compiled, git_commit, run_reaped, version, worker_env

RANKS = 4
VOCAB = 32000
SEQ, BATCH = 32, 4  # tokens per sample, samples per rank (the pipeline cuts it into 4 chunks)
STEPS = 2  # trained after setup is measured
LIMIT = 0.35  # issue 44: a meta cell's fullest rank, as a fraction of the model's bytes
#: cell -> (how the model is built, SGDTPStrategy options besides ``pretrained``, the layout in words)
CELLS: dict[str, tuple[str, dict[str, Any], str]] = {
    "today": ("from_pretrained", {"sharding": "full"}, "dp 4, sharding=full"),  # the layout of `sharded`
    "sharded": ("meta", {"sharding": "full"}, "dp 4, sharding=full"),
    "tensor": ("meta", {"parallelism": "tensor", "tensor_parallel_size": 4}, "tp 4 (k/v heads replicated)"),
    "pipeline": ("meta", {"pipeline_stages": 4, "pipeline_chunks": 4}, "pp 4, 4 micro-batches"),
    "pp2xtp2": (
        "meta",
        {"parallelism": "tensor", "tensor_parallel_size": 2, "pipeline_stages": 2, "pipeline_chunks": 2},
        "pp 2 x tp 2 (dp 1)",
    ),
    "dp2xtp2-full": (
        "meta",
        {"parallelism": "hybrid", "tensor_parallel_size": 2, "sharding": "full"},
        "dp 2 x tp 2, sharding=full",
    ),
    # not in the default run: no checkpoint, each module initialized by transformers' _init_weights on the host
    "sharded-init": ("meta-init", {"sharding": "full"}, "dp 4, sharding=full"),
    # not in the default run: today's path with the strategy's default layout (every rank keeps the whole model)
    "today-dp": ("from_pretrained", {}, "dp 4 (replicated)"),
}
DEFAULT_CELLS = ("today", "sharded", "tensor", "pipeline", "pp2xtp2", "dp2xtp2-full")
#: Imported on every rank before the baseline: modules setup imports lazily (the compiler, DCP, DTensor, pipelining,
#: transformers' loading code, the plugin's engines and reader), whose import is no part of the model's memory.
SETUP_IMPORTS = (
    "torch._dynamo",
    "torch._inductor",
    "torch.distributed.checkpoint",
    "torch.distributed.pipelining",
    "torch.distributed.tensor",
    "torch.distributed.tensor.parallel",
    "transformers.modeling_utils",
    "lightning_sgdtp.checkpoint.huggingface",
    "lightning_sgdtp.engine.compiled",
    "lightning_sgdtp.engine.materialize",
    "lightning_sgdtp.engine.pipelined",
)


# ------------------------------------------------------------------------------------------------ /proc
def proc_status() -> dict[str, int]:
    """``VmHWM``, ``VmRSS``, ``RssAnon``, ``RssFile`` of this process, in bytes."""
    text = Path("/proc/self/status").read_text()
    found = {k: re.search(rf"^{k}:\s+(\d+) kB", text, re.MULTILINE) for k in ("VmHWM", "VmRSS", "RssAnon", "RssFile")}
    return {k: 1024 * int(m.group(1)) for k, m in found.items() if m is not None}


def reset_peak() -> None:
    """``VmHWM`` := the current ``VmRSS`` (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class Sampler(threading.Thread):
    """Samples ``RssAnon`` / ``RssFile`` every ``period`` s: the highest ``RssAnon`` and, with ``timeline``, every
    sample and the marks (``mark(name)``), as (seconds since start, name or None, anon MiB, file MiB)."""

    def __init__(self, period: float = 0.02, timeline: bool = False) -> None:
        super().__init__(daemon=True)
        self.period, self.keep = period, timeline
        self.t0 = time.perf_counter()
        self.peak_anon = proc_status()["RssAnon"]
        self.timeline: list[tuple[float, str | None, float, float]] = []
        self.running = True

    def sample(self, name: str | None = None) -> None:
        s = proc_status()
        self.peak_anon = max(self.peak_anon, s["RssAnon"])
        if self.keep or name is not None:
            t = round(time.perf_counter() - self.t0, 3)
            self.timeline.append((t, name, round(s["RssAnon"] / 2**20, 1), round(s["RssFile"] / 2**20, 1)))

    def mark(self, name: str) -> None:
        self.sample(name)

    def run(self) -> None:
        while self.running:
            self.sample()
            time.sleep(self.period)


# ------------------------------------------------------------------------------------------------ worker
def _worker(cell: str, folder: Path, out: Path) -> None:
    """One rank of one cell (rank 0 is this process; Lightning's launcher starts ranks 1-3 with the same command)."""
    # 1. Everything heavy, before the baseline: what setup imports would otherwise count as the model's memory.
    import importlib

    import lightning.pytorch as L
    import torch
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2ForCausalLM

    from lightning_sgdtp import SGDTPStrategy
    from lightning_sgdtp.parallel.sharding import held_bytes

    for name in SETUP_IMPORTS:
        importlib.import_module(name)

    torch.set_num_threads(1)
    build, options, _ = CELLS[cell]
    config = Qwen2Config.from_pretrained(folder)
    sampler = Sampler(timeline=os.environ.get("SETUP_MEMORY_DEBUG") == "1")

    class Qwen2(L.LightningModule):
        """What a user writes: the Hugging Face model as ``self.model``, a loss logged every step, AdamW."""

        def __init__(self) -> None:
            super().__init__()
            self.model = (
                Qwen2ForCausalLM.from_pretrained(folder) if build == "from_pretrained" else Qwen2ForCausalLM(config)
            )

        def forward(self, ids: Any) -> Any:  # a pipeline traces forward and cuts it into stages
            return self.model(input_ids=ids).logits

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            ids, labels = batch
            logits = self(ids)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    figures: dict[str, Any] = {}

    class Measure(Callback):
        """The strategy's setup runs between ``setup`` (before ``configure_model``) and ``on_fit_start``."""

        def setup(self, trainer: Any, module: Any, stage: str) -> None:
            figures["setup_began"] = time.perf_counter()
            sampler.mark("callback setup (before the strategy's setup)")

        def on_fit_start(self, trainer: Any, module: Any) -> None:
            sampler.mark("on_fit_start (after the strategy's setup)")
            status = proc_status()
            engine = getattr(trainer.strategy, "engine", None)
            done = getattr(engine, "materialized", None)
            figures["setup"] = {
                "rank": trainer.global_rank,
                "baseline_rss": figures["baseline"]["VmRSS"],
                "baseline_anon": figures["baseline"]["RssAnon"],
                "hwm": status["VmHWM"],
                "rss_after": status["VmRSS"],
                "anon_after": status["RssAnon"],
                "file_after": status["RssFile"],
                "peak_anon_sampled": sampler.peak_anon,
                "build_s": figures["built"] - figures["t0"],
                "setup_s": time.perf_counter() - figures["setup_began"],
                "total_s": time.perf_counter() - figures["t0"],
                "held": held_bytes(module, []),
                "materialized": done.describe() if done is not None else None,
                "timeline": sampler.timeline,
            }

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            loss = trainer.callback_metrics.get("loss")
            figures.setdefault("losses", []).append(float(loss) if loss is not None else None)

        def on_train_end(self, trainer: Any, module: Any) -> None:
            mine = dict(figures["setup"], losses=figures.get("losses", []), **local_parameters_finite(trainer, module))
            mine["train_s"] = time.perf_counter() - figures["setup_began"] - mine["setup_s"]
            gathered: list[Any] = [None] * trainer.world_size
            torch.distributed.all_gather_object(gathered, mine)
            if trainer.global_rank == 0:
                figures["ranks"] = gathered

    strategy_options = dict(options)
    if build == "meta":
        strategy_options["pretrained"] = str(folder)
    strategy = SGDTPStrategy(**strategy_options)
    trainer = L.Trainer(
        accelerator="cpu", devices=RANKS, strategy=strategy, max_steps=STEPS, callbacks=[Measure()], **QUIET_TRAINER
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (RANKS * BATCH * 2, SEQ), generator=g)
    data = DataLoader(TensorDataset(ids, ids.clone()), batch_size=BATCH)

    # 2. The baseline; 3. the model; 4. setup, measured at on_fit_start.
    gc.collect()
    reset_peak()
    figures["baseline"] = proc_status()
    sampler.start()
    sampler.mark("baseline")
    figures["t0"] = time.perf_counter()
    if build == "from_pretrained":
        model = Qwen2()
    else:
        with trainer.init_module(empty_init=True):
            model = Qwen2()
    figures["built"] = time.perf_counter()
    sampler.mark("model built")
    trainer.fit(model, data)
    sampler.running = False
    if trainer.global_rank == 0:  # after fit: proof that the steps ran, compiled
        after = {"frames_compiled": frames_compiled()}
        out.write_text(json.dumps({"cell": cell, "ranks": figures["ranks"], "rank0_after_fit": after}))


# ------------------------------------------------------------------------------------------------ driver
def qwen2_config(hidden: int, heads: int, kv_heads: int, intermediate: int, layers: int, tied: bool = False) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=tied,
    )


def local_parameters_finite(trainer: Any, module: Any) -> dict[str, Any]:
    """Every parameter this rank holds (a DTensor's local shard; a pipeline rank's stages), after training: how many,
    their bytes, and the names of those not finite."""
    import torch
    from torch.distributed.tensor import DTensor

    runner = getattr(getattr(trainer.strategy, "engine", None), "runner", None)
    held = runner.local_parameters if runner is not None else list(module.parameters())
    names = {id(p): n for n, p in module.named_parameters()}
    bad, count, size = [], 0, 0
    for p in held:
        local = p.to_local() if isinstance(p, DTensor) else p
        if local.is_meta or local.numel() == 0:
            continue
        count, size = count + 1, size + local.numel() * local.element_size()
        if not bool(torch.isfinite(local.detach()).all()):
            bad.append(names.get(id(p), "?"))
    return {"checked_parameters": count, "checked_bytes": size, "nonfinite": bad, "global_step": trainer.global_step}


def write_checkpoint(config: Any, folder: Path) -> dict[str, Any]:
    """Build the model once (real weights), ``save_pretrained`` it to ``folder`` (reused when its config.json is
    the same), free it. Returns the model's figures."""
    import torch
    from transformers import Qwen2ForCausalLM

    wanted = config.to_dict()
    index = folder / "model_facts.json"
    if index.exists():
        facts = json.loads(index.read_text())
        if facts.get("config") == json.loads(json.dumps(wanted)):
            print(f"checkpoint: reusing {folder}", file=sys.stderr, flush=True)
            return facts
    folder.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    params = dict(model.named_parameters())
    facts = {
        "config": json.loads(json.dumps(wanted)),
        "parameters": sum(p.numel() for p in params.values()),
        "model_bytes": sum(p.numel() * p.element_size() for p in params.values()),
        "embedding_and_head_bytes": sum(
            p.numel() * p.element_size() for n, p in params.items() if "embed_tokens" in n or "lm_head" in n
        ),
        "layer_bytes": sum(p.numel() * p.element_size() for n, p in params.items() if ".layers.0." in n),
    }
    model.save_pretrained(folder)
    del model, params
    gc.collect()
    facts["files"] = sorted(p.name for p in folder.glob("*.safetensors"))
    facts["checkpoint_bytes"] = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    facts["write_s"] = time.perf_counter() - started
    index.write_text(json.dumps(facts, indent=1))
    return facts


def meminfo_gib(key: str) -> float:
    """A line of /proc/meminfo (the whole machine), in GiB."""
    text = Path("/proc/meminfo").read_text()
    return int(re.search(rf"^{key}:\s+(\d+) kB", text, re.MULTILINE).group(1)) / 2**20  # type: ignore[union-attr]


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "mem_total_gib": meminfo_gib("MemTotal"),
        "mem_available_gib": meminfo_gib("MemAvailable"),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": version("torch"),
        "lightning": version("lightning"),
        "transformers": version("transformers"),
        "safetensors": version("safetensors"),
        "commit": git_commit(),
    }


def run_cell(cell: str, folder: Path, tmp: Path, timeout: float) -> dict[str, Any]:
    out = tmp / f"{cell}.json"
    env = worker_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, str(SCRIPT), "--worker", cell, "--checkpoint", str(folder), "--out", str(out)]
    log = tmp / f"{cell}.log"
    started = time.perf_counter()
    lowest = [meminfo_gib("MemAvailable")]
    watching = threading.Event()

    def watch() -> None:  # the whole machine's lowest MemAvailable while the cell runs: how close to running out
        while not watching.wait(0.2):
            lowest.append(min(lowest[-1], meminfo_gib("MemAvailable")))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        rc = run_reaped(cmd, REPO, env, log, timeout)
    finally:
        watching.set()
        watcher.join()
    text = log.read_text(errors="replace")
    if rc != 0 or not out.exists():
        errors = [line for line in text.splitlines() if re.match(r"^(\[rank\d\]: )?[\w.]*(Error|Exception)\b", line)]
        raise RuntimeError(f"{cell} failed (rc={rc}): {' | '.join(dict.fromkeys(errors))}\n{text[-3000:]}")
    result = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - started
    result["min_mem_available_gib"] = lowest[-1]
    said = ("materialized on meta", "built whole on every rank", "tensor-parallel plan", "replicated: ")
    result["rank0_lines"] = [line.strip() for line in text.splitlines() if any(w in line for w in said)]
    return result


def summarize(cell: str, result: dict[str, Any], model_bytes: int) -> dict[str, Any]:
    ranks = sorted(result["ranks"], key=lambda r: r["rank"])
    frac = [(r["hwm"] - r["baseline_rss"]) / model_bytes for r in ranks]
    anon = [(r["peak_anon_sampled"] - r["baseline_anon"]) / model_bytes for r in ranks]
    return {
        "cell": cell,
        "build": CELLS[cell][0],
        "layout": CELLS[cell][2],
        "options": CELLS[cell][1],
        "fraction": frac,
        "max_fraction": max(frac),
        "min_fraction": min(frac),
        "added_mib": [(r["hwm"] - r["baseline_rss"]) / 2**20 for r in ranks],
        "anon_fraction_sampled": anon,
        "held_parameter_fraction": [r["held"]["parameters"] / model_bytes for r in ranks],
        "after_setup_fraction": [(r["rss_after"] - r["baseline_rss"]) / model_bytes for r in ranks],
        "baseline_mib": [r["baseline_rss"] / 2**20 for r in ranks],
        "build_s": max(r["build_s"] for r in ranks),
        "setup_s": max(r["setup_s"] for r in ranks),
        "total_s": max(r["total_s"] for r in ranks),
        "wall_s": result["wall_s"],
        "rank0_after_fit": result["rank0_after_fit"],
        "min_mem_available_gib": result["min_mem_available_gib"],
        "materialized": [r["materialized"] for r in ranks],
        "rank0_lines": result["rank0_lines"],
        "timelines": {r["rank"]: r["timeline"] for r in ranks if r["timeline"]},
        "trained": [
            {k: r[k] for k in ("rank", "global_step", "losses", "checked_parameters", "checked_bytes", "nonfinite")}
            for r in ranks
        ],
        "train_s": max(r["train_s"] for r in ranks),
    }


def main(args: argparse.Namespace) -> int:
    cells = [c.strip() for c in args.cells.split(",") if c.strip()]
    unknown = [c for c in cells if c not in CELLS]
    if unknown:
        print(f"unknown cell(s) {unknown}; known: {', '.join(CELLS)}", file=sys.stderr)
        return 2
    config = qwen2_config(args.hidden, args.heads, args.kv_heads, args.intermediate, args.layers, args.tied)
    facts_machine = machine()
    with tempfile.TemporaryDirectory(prefix="setup_memory_") as tmp_name:
        tmp = Path(tmp_name)
        folder = args.checkpoint or tmp / "pretrained"
        model = write_checkpoint(config, folder)
        mb = model["model_bytes"]
        print(
            f"model: Qwen2ForCausalLM hidden {config.hidden_size}, intermediate {config.intermediate_size},"
            f" {config.num_hidden_layers} layers, {config.num_attention_heads} heads ({config.num_key_value_heads}"
            f" key/value), vocabulary {config.vocab_size}, {'tied' if config.tie_word_embeddings else 'untied'} head:"
            f" {model['parameters'] / 1e6:.1f} M parameters, {mb / 1e9:.3f} GB fp32 ({mb / 2**30:.3f} GiB);"
            f" embedding + head {model['embedding_and_head_bytes'] / mb:.1%} of it; files {model['files']}",
            flush=True,
        )
        print(
            f"machine: {facts_machine['cpus']} CPUs, {facts_machine['mem_total_gib']:.1f} GiB"
            f" ({facts_machine['mem_available_gib']:.1f} available); today's path needs at least {RANKS} ranks x the"
            f" model = {RANKS * mb / 2**30:.1f} GiB, plus the checkpoint in the page cache",
            flush=True,
        )
        rows, failures = [], []
        for cell in cells:
            print(f"cell {cell}: {CELLS[cell][2]} ({CELLS[cell][0]})", file=sys.stderr, flush=True)
            try:
                rows.append(summarize(cell, run_cell(cell, folder, tmp, args.timeout), mb))
            except RuntimeError as e:
                failures.append({"cell": cell, "error": str(e)[-3000:]})
                print(f"FAILED: {e}", file=sys.stderr, flush=True)
    today = next((r for r in rows if r["cell"] == "today"), None)
    print()
    head = (
        f"{'cell':<13} {'build':<15} {'layout':<28} {'max':>6} {'x today':>7}  {'per rank':<27} {'MiB':>6}"
        f" {'anon':>6} {'held':>6} {'setup s':>7} {'train s':>7} {'avail GiB':>9}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        ratio = r["max_fraction"] / today["max_fraction"] if today else None
        r["ratio_vs_today"] = ratio
        per_rank = "/".join(f"{f:.3f}" for f in r["fraction"])
        print(
            f"{r['cell']:<13} {r['build']:<15} {r['layout']:<28} {r['max_fraction']:>6.3f} {fmt(ratio, '>7.2f')}"
            f"  {per_rank:<27} {max(r['added_mib']):>6.0f} {max(r['anon_fraction_sampled']):>6.3f}"
            f" {max(r['held_parameter_fraction']):>6.3f} {r['setup_s']:>7.1f} {r['train_s']:>7.1f}"
            f" {r['min_mem_available_gib']:>9.1f}"
        )
    print(
        "max / per rank: (VmHWM - VmRSS before the build) / model bytes; MiB: the fullest rank's in MiB; anon: the"
        " highest RssAnon sampled (file pages excluded), same scale; held: parameter bytes the rank holds after"
        " setup / model bytes; setup s: the strategy's setup (slowest rank); train s: the 2 steps after it, compiles"
        " included (slowest rank); avail GiB: the machine's lowest"
        " MemAvailable during the cell"
    )
    print()
    for r in rows:
        for line in r["rank0_lines"]:
            print(f"{r['cell']}: {line}")
    print()
    checks = []
    for r in rows:
        after = r["rank0_after_fit"]
        trained = [(x["global_step"], x["checked_parameters"], x["nonfinite"], x["losses"]) for x in r["trained"]]
        finite = all(
            step == STEPS and count > 0 and not bad and len(losses) == STEPS for step, count, bad, losses in trained
        )
        # the loss as every rank's logger sees it (a pipeline's last stage computes it, its value reaches every rank)
        finite = finite and all(_finite(v) for t in trained for v in t[3])
        checks.append(
            f"[{'PASS' if finite and after['frames_compiled'] else 'FAIL'}] {r['cell']}: {STEPS} steps trained on every"
            f" rank, every local parameter finite (checked per rank: {[t[1] for t in trained]}), losses"
            f" {[round(v, 4) if v is not None else None for v in trained[0][3]]}, {after['frames_compiled']} frames compiled"
        )
        if r["build"] == "meta-init":  # no checkpoint: outside the criterion
            checks.append(
                f"[INFO] {r['cell']}: fullest rank {r['max_fraction']:.3f} of the model (no pretrained; the host holds"
                " each module whole while it is initialized, the largest an embedding)"
            )
        elif r["build"] == "meta":
            ok = r["max_fraction"] <= LIMIT
            checks.append(
                f"[{'PASS' if ok else 'FAIL'}] {r['cell']}: fullest rank {r['max_fraction']:.3f} of the model"
                f" (target <= {LIMIT})"
            )
        elif r["cell"] == "today":
            ok = r["min_fraction"] >= 1.0
            checks.append(
                f"[{'PASS' if ok else 'FAIL'}] today's path: every rank >= 1.0 of the model (lowest"
                f" {r['min_fraction']:.3f})"
            )
            said = any(
                "built whole on every rank" in line and "init_module(empty_init=True)" in line
                for line in r["rank0_lines"]
            )
            checks.append(
                f"[{'PASS' if said else 'FAIL'}] today's path: rank 0 says the model came whole, with the fix"
            )
    checks += [f"[FAIL] {f['cell']}: the cell failed" for f in failures]
    for line in checks:
        print(line)
    summary = {
        "benchmark": "setup_memory",
        "date": date.today().isoformat(),
        "machine": facts_machine,
        "ranks": RANKS,
        "measure": "(VmHWM at on_fit_start - VmRSS before the model is built) / fp32 parameter bytes, per rank",
        "model": {k: v for k, v in model.items() if k != "write_s"},
        "criterion": {"meta_cells_max": LIMIT, "today_min": 1.0},
        "rows": rows,
        "checks": checks,
        "failures": failures,
    }
    out = args.out or REPO / "benchmarks" / "results" / f"setup_memory_{date.today().isoformat()}.json"
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"written: {out}")
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"} | {"rows": [_short(r) for r in rows]}))
    return 1 if failures or any(c.startswith("[FAIL]") for c in checks) else 0


def _finite(value: Any) -> bool:
    return value is not None and math.isfinite(value)


def _short(row: dict[str, Any]) -> dict[str, Any]:
    return {k: row[k] for k in ("cell", "max_fraction", "fraction", "ratio_vs_today", "setup_s")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1536, help="hidden size (Qwen2.5-1.5B's)")
    p.add_argument("--heads", type=int, default=12, help="query heads (tp 4 must divide them)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (2: fewer than the 4 tp ranks)")
    p.add_argument("--intermediate", type=int, default=8960, help="MLP width")
    p.add_argument("--layers", type=int, default=12, help="decoder layers (a multiple of 4: pipeline stages)")
    p.add_argument(
        "--tied",
        action="store_true",
        help="the head tied to the embedding, as Qwen2.5-1.5B's (the split's balance counts the tied copy once)",
    )
    p.add_argument("--cells", default=",".join(DEFAULT_CELLS), help=f"comma-separated, of: {', '.join(CELLS)}")
    p.add_argument("--checkpoint", type=Path, default=None, help="where the checkpoint is written (kept, reused)")
    p.add_argument("--timeout", type=float, default=900, help="hard limit per cell, seconds")
    p.add_argument("--out", type=Path, default=None, help="the JSON summary")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    a = parse_args()
    if a.worker:
        _worker(a.worker, a.checkpoint, a.out)
        sys.exit(0)
    sys.exit(main(a))
