"""The ``sgdtp`` command. ``sgdtp diagnose TARGET [--json]``; see ``sgdtp diagnose --help``.

TARGET names a factory: ``path/to/file.py:make`` or ``package.module:make`` (``:make`` is the default name). The
factory takes no arguments and returns ``(module, example_batch)`` or ``(module, example_batch, step_fn)``; the
file is imported as a module, so ops it registers with ``lightning_sgdtp.graph`` at import are live. Without a
TARGET, ``sgdtp diagnose`` checks the compile cache only.

Exit status: 0 when diagnose ran (whatever it found; with ``--strict``: 1 when it found an error), 2 when the
TARGET could not be loaded.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


class TargetError(Exception):
    """The TARGET of ``sgdtp diagnose`` cannot be loaded or does not return what it should."""


def load_factory(target: str) -> Callable[[], Any]:
    """The factory named by ``path/to/file.py:name`` or ``package.module:name`` (``name`` defaults to ``make``)."""
    spec, _, name = target.rpartition(":") if ":" in target and not _is_drive(target) else (target, "", "")
    name = name or "make"
    if spec.endswith(".py") or Path(spec).is_file():
        path = Path(spec).expanduser().resolve()
        if not path.is_file():
            raise TargetError(f"{spec}: no such file")
        sys.path.insert(0, str(path.parent))
        module_spec = importlib.util.spec_from_file_location(f"_sgdtp_target_{path.stem}", path)
        if module_spec is None or module_spec.loader is None:
            raise TargetError(f"{spec}: cannot import this file")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = module
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(spec)
        except ImportError as e:
            raise TargetError(f"{spec}: cannot import ({e})") from e
    factory = getattr(module, name, None)
    if not callable(factory):
        raise TargetError(
            f"{spec} has no callable {name!r} (TARGET is path/to/file.py:factory or package.module:factory)"
        )
    return factory


def _plan_topology(path: str | None) -> Any:
    """The ``--topology`` file as the topology of one node (None without it); a file that cannot be read, named."""
    if path is None:
        return None
    from lightning_sgdtp.mesh.topology import Topology, TopologyError
    from lightning_sgdtp.planner.units import PlannerInputError

    try:
        return Topology.from_nvidia_smi(Path(path).read_text())
    except (OSError, UnicodeDecodeError, TopologyError) as e:
        raise PlannerInputError(
            f"--topology {path}: {e}. Give the output of `nvidia-smi topo -m` on one node, saved as text (examples:"
            " tests/data/topology/)."
        ) from e


def _plan_hardware(args: argparse.Namespace, topology: Any) -> tuple[Any, int]:
    """The hardware of ``sgdtp plan`` (``--hardware``, ``--gpu-memory``, the topology of one node) and devices per
    node, from inputs ``check_inputs`` passed."""
    import dataclasses

    from lightning_sgdtp.planner.cost import HARDWARE, PCIE
    from lightning_sgdtp.planner.units import parse_memory

    hardware = HARDWARE[args.hardware]
    if args.gpu_memory is not None:
        hardware = dataclasses.replace(hardware, memory_bytes=parse_memory(args.gpu_memory))
    if topology is None:
        return hardware, args.gpus_per_node if args.gpus_per_node is not None else 8
    topology = dataclasses.replace(topology, num_nodes=args.nodes)
    per_node = topology.devices_per_node
    island = topology.auto_tp_size() if topology.has_nvlink() else 1
    node_link = hardware.node_link if island == per_node else PCIE
    hardware = dataclasses.replace(
        hardware, island=island, node_link=node_link, name=f"{hardware.name}, {topology.describe()}"
    )
    return hardware, per_node


def _plan_module(target: str) -> Any:
    """The module of ``sgdtp plan``'s TARGET: a named shape, or what the factory builds on the meta device."""
    import torch

    from lightning_sgdtp.planner.shapes import SHAPES, build

    if target in SHAPES:
        return build(target)
    factory = load_factory(target)
    with torch.device("meta"):  # the model's shapes only: no memory, whatever its size
        try:
            return factory()
        except Exception as e:
            raise TargetError(f"{target}() failed: {type(e).__name__}: {e} (it must take no argument)") from e


def _plan(args: argparse.Namespace) -> int:
    import dataclasses

    from lightning_sgdtp.planner.cost import profile
    from lightning_sgdtp.planner.inputs import CLI, check_inputs, parse_fix
    from lightning_sgdtp.planner.search import PlannerInputError, check_a_layout_is_left, plan
    from lightning_sgdtp.planner.shapes import SHAPES

    try:
        fixed = parse_fix(args.fix)
        topology = _plan_topology(args.topology)
        module = _plan_module(args.target)
        check_inputs(
            module=module,
            nodes=args.nodes,
            devices_per_node=args.gpus_per_node,
            topology_devices=topology.devices_per_node if topology is not None else None,
            memory=args.gpu_memory,
            tokens=args.seq_len,
            batch=args.batch,
            global_batch=args.global_batch,
            optimizer_states=args.optimizer_states,
            rows=args.rows,
            fixed=fixed,
            spelling=dataclasses.replace(CLI, names={**CLI.names, "module": f"TARGET {args.target}"}),
        )
        hardware, per_node = _plan_hardware(args, topology)
        shape = SHAPES.get(args.target)
        tokens = args.seq_len or (shape.tokens if shape else 1)
        batch = args.batch or (shape.batch if shape else 1)
        model = profile(module, tokens, batch, activation_bytes=2 if args.precision.startswith(("bf16", "16")) else 4)
        world = args.nodes * per_node
        result = plan(
            module, model, hardware, world, per_node, None, args.optimizer_states, fixed, args.global_batch,
            materialized=args.materialized,  # the module here is on meta whatever the job builds: the flag says
        )  # fmt: skip
        if fixed:
            check_a_layout_is_left(result, world, fixed)
    except (TargetError, PlannerInputError, ValueError) as e:
        print(f"sgdtp plan: {e}", file=sys.stderr)
        return 2
    try:
        print(json.dumps(result.to_dict(), indent=1) if args.json else "\n".join(result.describe(args.rows)))
    except BrokenPipeError:  # `sgdtp plan ... | head`: the reader has what it wanted
        sys.stderr.close()
    return 0


def _is_drive(target: str) -> bool:  # C:\path\file.py on Windows
    return len(target) > 2 and target[1] == ":" and target[2] in "\\/" and target.count(":") == 1


def _unpack(made: Any, target: str) -> tuple[Any, Any, Any]:
    if isinstance(made, (tuple, list)) and len(made) in (2, 3):
        module, batch, *rest = made
        return module, batch, (rest[0] if rest else None)
    raise TargetError(
        f"{target} returned {type(made).__name__}; expected (module, example_batch) or (module, example_batch, step_fn)"
    )


def _diagnose(args: argparse.Namespace) -> int:
    from lightning_sgdtp.diagnose import Diagnosis, diagnose
    from lightning_sgdtp.diagnose.compile_cache_hygiene import cache_path, check_compile_cache

    if args.target is None:
        findings = check_compile_cache(args.cache_dir, write_marker=not args.no_marker)
        result = Diagnosis(
            target="compile cache",
            backend="-",
            findings=findings,
            stats={"cache_dir": str(cache_path(args.cache_dir))},
        )
    else:
        try:
            module, batch, step_fn = _unpack(load_factory(args.target)(), args.target)
        except TargetError as e:
            print(f"sgdtp diagnose: {e}", file=sys.stderr)
            return 2
        result = diagnose(
            module,
            batch,
            step_fn,
            backend=args.backend,
            backward=not args.no_backward,
            check_cache=not args.no_cache,
            cache_dir=args.cache_dir,
            write_cache_marker=not args.no_marker,
        )
    print(result.to_json() if args.json else result.to_text())
    return 1 if args.strict and not result.ok else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sgdtp", description="lightning-sgdtp tools")
    commands = parser.add_subparsers(dest="command", required=True)
    d = commands.add_parser(
        "diagnose",
        help="compile a training step the way the sgdtp strategy does and report what goes wrong",
        description=(
            "Graph breaks (with source lines), recompilations (with the failed guards), parameters on mixed devices,"
            " custom ops used on a device their specs refuse, and a stale or foreign compile cache. Each finding"
            " says what to do."
        ),
    )
    d.add_argument(
        "target",
        nargs="?",
        help="path/to/file.py:factory or package.module:factory; factory() returns (module, example_batch[, step_fn])."
        " Omit to check the compile cache only",
    )
    d.add_argument("--json", action="store_true", help="print JSON instead of text")
    d.add_argument(
        "--backend", default="sgdtp", help="'sgdtp' (the strategy's backend, default) or a TorchDynamo backend name"
    )
    d.add_argument("--no-backward", action="store_true", help="do not run backward through the compiled step")
    d.add_argument("--no-cache", action="store_true", help="skip the compile-cache check")
    d.add_argument("--cache-dir", default=None, help="the compile cache to check (default: Inductor's)")
    d.add_argument("--no-marker", action="store_true", help="do not write the version marker into the cache")
    d.add_argument("--strict", action="store_true", help="exit 1 when an error is found")
    d.set_defaults(run=_diagnose)

    doc = commands.add_parser(
        "doctor",
        help="can this machine run lightning-sgdtp? versions, builds, GPUs, backends, compilers; the fix for each",
    )
    doc.add_argument("--json", action="store_true", help="print JSON instead of the table")
    doc.add_argument("--env", type=Path, default=None, help="check a recorded environment (JSON) instead of probing")
    doc.add_argument("--save", type=Path, default=None, help="write this machine's probed environment as JSON")
    doc.add_argument(
        "--sbatch",
        type=Path,
        default=None,
        help="also check a SLURM batch script: GPUs per node and --devices against --ntasks-per-node",
    )
    doc.set_defaults(run=_doctor)

    plan = commands.add_parser(
        "plan",
        help="the layout a model should train with on N nodes x G GPUs: predicted step time and memory per layout",
        description=(
            "Builds the model on the meta device (no memory, no process group, no GPU) and predicts, for every"
            " dp x tp x pp x sharding (and checkpointing, micro-batches, hybrid sharding), the step time and the"
            " memory on the fullest rank; prints the fastest that fits first, and its setup peak per rank"
            " (docs/planner.md)."
        ),
    )
    plan.add_argument(
        "target",
        help="a named shape (llama3-8b, llama3-70b, llama3-405b) or path/to/file.py:factory or"
        " package.module:factory; factory() returns the module",
    )
    plan.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    plan.add_argument("--gpus-per-node", type=int, default=None, help="devices per node (default 8, or the topology's)")
    plan.add_argument("--hardware", choices=["h100", "a100"], default="h100", help="the GPU's given figures")
    plan.add_argument("--gpu-memory", default=None, help="memory per device, e.g. 80GB (default: the hardware's)")
    plan.add_argument("--topology", default=None, help="`nvidia-smi topo -m` of one node, saved as text")
    plan.add_argument("--seq-len", type=int, default=None, help="tokens per sample (named shapes: 8192)")
    plan.add_argument("--batch", type=int, default=None, help="samples per data-parallel replica per step")
    plan.add_argument("--global-batch", type=int, default=None, help="samples per step over all replicas, fixed")
    plan.add_argument(
        "--precision", default="bf16-mixed", help="Trainer precision (activation size; default bf16-mixed)"
    )
    plan.add_argument("--fix", action="append", default=[], help="NAME=VALUE kept fixed (tp=8, sharding=full, ...)")
    plan.add_argument("--rows", type=int, default=12, help="layouts printed (default 12)")
    plan.add_argument("--optimizer-states", type=int, default=2, help="state tensors per parameter (AdamW: 2)")
    plan.add_argument(
        "--materialized",
        action="store_true",
        help="plan for a model built whole on every rank (the whole model at setup); default: built on the meta"
        " device, each rank materializing its part",
    )
    plan.add_argument("--json", action="store_true", help="print JSON instead of the table")
    plan.set_defaults(run=_plan)

    target = "a one-file checkpoint, a folder of them, or any other folder"
    sign = _folder_command(commands, "sign", _sign, dir_help=target)
    sign.add_argument("--gpg-key", default=None, help="sign with gpg: key id, fingerprint or email")
    sign.add_argument("--gnupg-home", default=None, help="gpg's home directory (default: gpg's own)")
    sign.add_argument("--pem-key", type=Path, default=None, help="sign with a PEM private key (Ed25519, RSA, EC)")

    verify = _folder_command(commands, "verify", _verify, dir_help=target)
    verify.add_argument("--keyring", type=Path, default=None, help="trusted keys: a gpg keyring (checked with gpgv)")
    verify.add_argument("--pem-public-key", type=Path, default=None, help="trusted key: a PEM public key")

    cons = _folder_command(commands, "consolidate", _consolidate, dir_help="the sharded checkpoint folder")
    cons.add_argument(
        "output", type=Path, nargs="?", help="the file to write (Lightning's layout: state_dict, optimizer_states)"
    )
    cons.add_argument(
        "--hf",
        type=Path,
        default=None,
        metavar="OUT",
        help="instead, write the model as a Hugging Face folder OUT (*.safetensors and model.safetensors.index.json;"
        " one tensor in memory at a time) that from_pretrained loads",
    )
    cons.add_argument(
        "--config",
        type=Path,
        default=None,
        help="with --hf: the Hugging Face model's folder (config.json): names and shapes checked against the model it"
        " describes, config.json and generation_config.json copied",
    )
    cons.add_argument(
        "--prefix",
        default=None,
        help="with --hf: the LightningModule's path to the Hugging Face model, stripped from the names ('model.' for"
        " self.model; default: found from --config, or the leading components all names share)",
    )
    cons.add_argument("--keyring", type=Path, default=None, help="verify the folder's signature with this gpg keyring")
    cons.add_argument("--no-verify", action="store_true", help="do not check the folder's SHA256 manifest first")
    return parser


def _folder_command(
    commands: Any, name: str, run: Callable[[argparse.Namespace], int], dir_help: str | None = None
) -> argparse.ArgumentParser:
    """A subcommand ``sgdtp NAME DIR ...`` that ``main`` dispatches to ``run``; ``run``'s docstring is its help."""
    command = commands.add_parser(name, help=run.__doc__)
    command.add_argument("dir", type=Path, help=dir_help)
    command.set_defaults(run=run)
    return command


def _verified(path: Path, trusted: Path | None) -> bool:
    """``verify_path``; on failure the reason goes to stderr."""
    from lightning_sgdtp.trust import ArtifactVerificationError
    from lightning_sgdtp.trust.sealed import verify_path

    try:
        verify_path(path, trusted=trusted)
    except ArtifactVerificationError as err:
        print(err, file=sys.stderr)
        return False
    return True


def _consolidate(args: argparse.Namespace) -> int:
    """merge a sharded checkpoint folder (tensor/hybrid parallel) into one file that plain torch.load reads, or
    (--hf OUT) into a Hugging Face folder that from_pretrained loads"""
    from lightning_sgdtp.checkpoint.huggingface import INDEX
    from lightning_sgdtp.checkpoint.sharded import consolidate, consolidate_hf

    if (args.output is None) == (args.hf is None):
        print(
            "sgdtp consolidate: give OUTPUT (one torch.save file) or --hf OUT (a Hugging Face folder)", file=sys.stderr
        )
        return 2
    if args.hf is None and (args.config or args.prefix is not None):
        print("sgdtp consolidate: --config and --prefix go with --hf OUT", file=sys.stderr)
        return 2
    # consolidate unpickles meta.pt, both read DCP's .metadata (a pickle too): check the folder first
    if not args.no_verify and not _verified(args.dir, args.keyring):
        return 1
    try:
        if args.hf is None:
            print(f"wrote {consolidate(args.dir, args.output)}")
            return 0
        out = consolidate_hf(args.dir, args.hf, prefix=args.prefix, config=args.config)
    except (FileNotFoundError, ValueError, ImportError) as err:
        print(f"sgdtp consolidate: {err}", file=sys.stderr)
        return 1
    index = json.loads((out / INDEX).read_text())
    files = len(set(index["weight_map"].values()))
    config = "config.json copied" if args.config else "no config.json: copy one in, or give --config"
    print(
        f"wrote {out}: {len(index['weight_map'])} tensors in {files} safetensors files, {index['metadata']['total_size']}"
        f" bytes, and {INDEX}; {config}"
    )
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from lightning_sgdtp.observe import doctor

    env = json.loads(args.env.read_text()) if args.env else doctor.probe()
    if args.save:
        args.save.write_text(json.dumps(env, indent=1, sort_keys=True))
    rows = doctor.check(env)
    if args.sbatch:
        try:
            rows += doctor.check_sbatch(args.sbatch.read_text())
        except (OSError, ValueError) as err:
            print(f"sgdtp doctor: {args.sbatch}: {err}", file=sys.stderr)
            return 2
    result = doctor.report(env, rows)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        doctor.render(env, rows)
    return 0 if result["ok"] else 1


def _sign(args: argparse.Namespace) -> int:
    """seal a one-file checkpoint, or each of a folder of them, with the SHA256 of its bytes (kept inside the file);
    any other folder gets DIR/SGDTP-MANIFEST.json (path, size, SHA256 of every file); with a key, signed"""
    from lightning_sgdtp.trust import MANIFEST
    from lightning_sgdtp.trust.sealed import sign_path

    try:
        written = sign_path(args.dir, gpg_key=args.gpg_key, gnupg_home=args.gnupg_home, pem_key=args.pem_key)
    except ValueError as err:
        print(f"sgdtp sign: {err}", file=sys.stderr)
        return 2
    signed = " and signed" if args.gpg_key or args.pem_key else " (unsigned: no --gpg-key or --pem-key)"
    what = "wrote" if written[0].name == MANIFEST else "sealed"
    print(f"{what} {', '.join(map(str, written))}{signed}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    """check a one-file checkpoint (or each of a folder of them) against its seal, any other folder against its
    manifest (sizes, SHA256, no extra files); and the signature"""
    if args.keyring and args.pem_public_key:
        print("sgdtp verify: give --keyring or --pem-public-key, not both", file=sys.stderr)
        return 2
    if not _verified(args.dir, args.keyring or args.pem_public_key):
        return 1
    how = "signature and " if args.keyring or args.pem_public_key else "(no signature checked) "
    print(f"{args.dir}: {how}every {'file' if args.dir.is_dir() else 'record'} verified")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
