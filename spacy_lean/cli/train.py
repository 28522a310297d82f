"""`spacy lean train`: `spacy train`, data-parallel over processes and GPUs
(torch.distributed), resumable, with out-of-memory-safe updates."""

import contextlib
import logging
import math
import os
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Dict, Iterator, List, NoReturn, Optional

import typer
from spacy import util
from spacy.cli._util import import_code, parse_config_overrides, setup_gpu, show_validation_error
from spacy.language import Language
from wasabi import Printer

from . import lean_cli

if TYPE_CHECKING:
    from ..training.dist import DistContext
    from ..training.update import UpdatePolicy


def parse_gpu_ids(value: Optional[str]) -> List[int]:
    """'0,1,3' -> [0, 1, 3]; None, '' or '-1' -> [] (the CPU)."""
    if not value or value.strip() == "-1":
        return []
    try:
        ids = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise ValueError(
            f"--gpu-ids must be comma-separated integers such as 0,1, got {value!r}."
        ) from None
    if any(i < 0 for i in ids):
        raise ValueError(
            f"--gpu-ids must be >= 0, got {value!r}; use -1 (or leave it out) to train on the CPU."
        )
    return ids


@contextlib.contextmanager
def _our_setting_errors(
    msg: Printer, config_path: Path, dctx: Optional["DistContext"]
) -> Iterator[None]:
    """A bad setting of one of spacy-lean's registered functions (its ValueError names
    the function, "spacy-lean.<name>: ...", the setting and the fix) fails with its
    message, not a traceback; other errors propagate."""
    try:
        yield
    except ValueError as err:
        if not str(err).startswith("spacy-lean."):
            raise
        _fail(msg, f"{config_path}: {err}", dctx)


@contextlib.contextmanager
def _single_process_view() -> Iterator[None]:
    """Hide RANK/WORLD_SIZE while the pipeline is initialized, so every rank reads the
    same examples for labels and shapes as one process would (rank-aware readers then
    read everything), and builds the same model."""
    saved = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE") if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def _saved_model_error(saved_model: Path, config_path: Path, err: Exception) -> str:
    """What to say when the saved pipeline does not load into the config's pipeline,
    found by loading it on its own, in steps: its config.cfg built with the code loaded
    now (where that fails, the code changed too), then its files read (missing or
    damaged); where all of that works, the config builds another pipeline than the
    run's (thinc's "Attempt to change dimension ...", or a component added)."""
    from ..training.dist import STATE_FIX

    def missing(own: FileNotFoundError) -> str:
        return (
            f"The saved pipeline's file {own.filename} is missing: the training state in "
            f"{saved_model.parent} is incomplete. {STATE_FIX}"
        )

    def damaged(own: Exception) -> str:
        return (
            f"Could not read the saved pipeline {saved_model} ({type(own).__name__}: {own}): "
            "one of its files is truncated or damaged (it does not load with its own "
            f"config.cfg either). {STATE_FIX}"
        )

    run_config = saved_model / "config.cfg"
    differs = (
        f"Could not load the saved pipeline {saved_model} into the pipeline of {config_path} "
        f"({type(err).__name__}: {err}): the config builds another pipeline than the run's (a "
        "component added, or a setting that shapes a model)."
    )
    fix = (
        f"Resume with the config the run was started with (its copy: {run_config}), or train "
        "again without --resume (into another --output folder to keep this one)"
    )
    try:
        own_config = util.load_config(run_config)
    except FileNotFoundError as own:
        return missing(own)
    except Exception as own:
        return damaged(own)
    try:
        own_nlp = util.load_model_from_config(own_config, auto_fill=True)
    except Exception as own:
        # A function of the run's config that the code loaded now does not register.
        return (
            f"{differs} The run's own config does not build with the code loaded now either "
            f"({type(own).__name__}: {str(own).splitlines()[0]}). {fix}, and the --code it "
            "was started with."
        )
    try:
        own_nlp.from_disk(saved_model, exclude=["config"])
    except FileNotFoundError as own:
        return missing(own)
    except Exception as own:
        return damaged(own)
    return f"{differs} {fix}."


def _pipeline_to_resume(config, gpu_id: int) -> Language:
    """The config's pipeline, for a resume to load the saved weights into. On a GPU the
    config's [training] gpu_allocator is set first, as `init_nlp` sets it before a new
    run builds its pipeline: the weights are then allocated by it. (Set later, in the
    loop, the weights and what loading them left cached stayed in cupy's own pool,
    apart from torch's, for the whole run.)"""
    if gpu_id >= 0:
        allocator = config.interpolate().get("training", {}).get("gpu_allocator")
        if allocator:
            from thinc.api import set_gpu_allocator

            set_gpu_allocator(allocator)
    return util.load_model_from_config(config, auto_fill=True)


def _name_rank_in_warnings(rank: int, world_size: int) -> None:
    """Warnings go to stderr on every rank (each rank meets its own data and its own
    out-of-memory splits): a rank other than 0 names itself in front of each, so that
    N copies of a data warning read as N ranks', and a split says whose batch it was.
    The text is changed where it is formatted: handlers still get the Warning itself."""
    import warnings

    if getattr(warnings.formatwarning, "names_rank", False):
        return
    format_warning = warnings.formatwarning

    def formatwarning(message, category, filename, lineno, line=None):
        text = f"Rank {rank} of {world_size}: {message}"
        return format_warning(text, category, filename, lineno, line)

    formatwarning.names_rank = True  # type: ignore[attr-defined]
    warnings.formatwarning = formatwarning


def _name_rank_in_logs(rank: int, world_size: int) -> None:
    """spaCy's logger (`-V`: its debug lines) on a rank other than 0 keeps its warnings
    and errors only, each naming the rank: with `--nproc N` every line came N times,
    where only rank 0 should print."""

    class RankLines(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            if record.levelno < logging.WARNING:
                return False
            record.msg = f"Rank {rank} of {world_size}: {record.msg}"
            return True

    if not any(type(f).__name__ == "RankLines" for f in util.logger.filters):  # once
        util.logger.addFilter(RankLines())


GPU_FIX = (
    "Leave out --gpu-id/--gpu-ids to train on the CPU, or install cupy for your CUDA version "
    "(pip install spacy-lean[cuda12x])."
)


def _no_gpu_reason() -> Optional[str]:
    """Why thinc's `require_gpu` would refuse, said before any process starts (the
    check itself would start CUDA in this one); None where it would not."""
    import platform

    from thinc import util as thinc_util

    if platform.system() != "Darwin" and not thinc_util.has_cupy:
        return "cupy is not installed, which spaCy's GPU training needs"
    if not thinc_util.has_gpu:
        return "no GPU is visible (CUDA_VISIBLE_DEVICES, drivers)"
    return None


def _fail(msg: Printer, text: str, dctx: Optional["DistContext"] = None) -> NoReturn:
    """`msg.fail(text, exits=1)` (a wasabi printer made with no_print exits with a
    stack trace). Rank 0 prints; so does local rank 0 of every other node, which may
    fail where rank 0 does not (node-local files), prefixed with its rank. The other
    ranks of a node fail as its local rank 0 does, and exit 1 quietly."""
    if dctx is not None and not dctx.is_main and dctx.local_rank == 0:
        Printer().fail(f"Rank {dctx.rank} of {dctx.world_size}: {text}")
    else:
        msg.fail(text)
    sys.exit(1)


@lean_cli.command(
    "train", context_settings={"allow_extra_args": True, "ignore_unknown_options": True}
)
def train_cli(
    # fmt: off
    ctx: typer.Context,  # holds the config overrides (--paths.train ...)
    config_path: Path = typer.Argument(..., help=(
        "Path to config file"), exists=True, allow_dash=True),
    output_path: Optional[Path] = typer.Option(None, "--output", "--output-path", "-o", help=(
        "Output directory: model-best, model-last, training-state")),
    code_path: Optional[Path] = typer.Option(None, "--code", "-c", help=(
        "Path to Python file with additional code (registered functions) to be imported")),
    verbose: bool = typer.Option(False, "--verbose", "-V", "-VV", help=(
        "Display more information for debugging purposes")),
    use_gpu: int = typer.Option(-1, "--gpu-id", "-g", help=(
        "GPU ID or -1 for CPU (one process; see --gpu-ids for several)")),
    gpu_ids: Optional[str] = typer.Option(None, "--gpu-ids", help=(
        "Comma-separated GPU ids, one process per GPU (nccl): give as many as --nproc; local "
        "rank i uses the i-th")),
    nproc: int = typer.Option(1, "--nproc", "-n", help=(
        "Start this many processes on this machine (gloo on the CPU, nccl with GPUs). Under "
        "torchrun leave it at 1")),
    dist_backend: str = typer.Option("auto", "--dist-backend", help=(
        "torch.distributed backend: auto (nccl with GPUs, gloo on the CPU), nccl or gloo (GPUs "
        "too: gradients summed through host memory; e.g. several ranks on one GPU)")),
    resume: bool = typer.Option(False, "--resume", help=(
        "Continue the run saved in OUTPUT/training-state (any number of processes)")),
    timeout: float = typer.Option(600.0, "--timeout", help=(
        "Seconds a rank waits for the others in a collective before the run fails")),
    max_padded_tokens: Optional[int] = typer.Option(None, "--max-padded-tokens", help=(
        "Ceiling in padded tokens per micro-batch (gradient accumulation by tokens)")),
    # fmt: on
):
    """Train a spaCy pipeline like `spacy train`, on one or several processes.

    Takes every option and config override of `spacy train` (`--paths.train ...`).
    With `--nproc N` it starts N processes on this machine; under `torchrun` each
    process it starts is one rank (multi-node with torchrun's rendezvous flags). Each
    rank reads its share of the training and dev data, the gradients are summed over
    the ranks before every optimizer step, and only rank 0 logs and writes.
    """
    if verbose:
        util.logger.setLevel(logging.DEBUG)
    msg = Printer()
    try:
        ids = parse_gpu_ids(gpu_ids)
    except ValueError as err:
        msg.fail(str(err), exits=1)
    if use_gpu >= 0 and ids:
        msg.fail(
            f"--gpu-id {use_gpu} and --gpu-ids {gpu_ids} both name GPUs: give --gpu-id for "
            "one process, or --gpu-ids with --nproc for several.",
            exits=1,
        )
    if use_gpu >= 0:
        ids = [use_gpu]
    if nproc < 1:
        msg.fail(f"--nproc must be >= 1, got {nproc}.", exits=1)
    from ..training.launch import launched_by_us

    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    a_rank = under_torchrun or launched_by_us()  # a rank (its GPU is checked as it starts)
    if len(ids) > nproc and not a_rank:
        msg.fail(
            f"--gpu-ids names {len(ids)} GPUs ({gpu_ids}) for {nproc} process(es): a process "
            f"trains on one GPU, so {len(ids) - nproc} would stay idle. Add --nproc "
            f"{len(ids)} to train on all of them, or list only the GPUs to use.",
            exits=1,
        )
    if ids and not a_rank:
        unavailable = _no_gpu_reason()
        if unavailable:
            msg.fail(f"GPU {','.join(map(str, ids))}: {unavailable}.", GPU_FIX, exits=1)
    if not (math.isfinite(timeout) and timeout > 0):
        msg.fail(
            f"--timeout must be a number of seconds > 0, got {timeout}: how long a rank waits "
            "for the others in a collective before the run stops (default 600).",
            exits=1,
        )
    if max_padded_tokens is not None and max_padded_tokens < 1:
        # Checked again with the config's setting; said here before anything starts.
        msg.fail(
            f"--max-padded-tokens must be a positive number of padded tokens, got "
            f"{max_padded_tokens}. Leave it out for no ceiling.",
            exits=1,
        )
    if resume and output_path is None:
        msg.fail("--resume needs --output: the folder of the run to continue.", exits=1)
    from ..training.dist import check_backend

    try:
        check_backend(dist_backend, ids)
    except ValueError as err:
        msg.fail(str(err), exits=1)
    if nproc > 1 and not launched_by_us():
        if under_torchrun:
            msg.fail(
                "--nproc starts processes itself; under torchrun leave it out (torchrun's "
                "--nproc-per-node sets the number of processes).",
                exits=1,
            )
        if ids and len(ids) < nproc:
            msg.warn(f"{nproc} processes share {len(ids)} GPU(s): {ids}")
        argv = [sys.executable, "-m", "spacy", "lean", "train", str(config_path)]
        if output_path is not None:
            argv += ["--output", str(output_path)]
        if code_path is not None:
            argv += ["--code", str(code_path)]
        if verbose:
            argv.append("--verbose")
        if ids:
            argv += ["--gpu-ids", ",".join(str(i) for i in ids)]
        if resume:
            argv.append("--resume")
        if max_padded_tokens is not None:
            argv += ["--max-padded-tokens", str(max_padded_tokens)]
        argv += ["--dist-backend", dist_backend, "--timeout", str(timeout), *ctx.args]
        msg.info(f"Starting {nproc} processes")
        from ..training.launch import launch_local

        with contextlib.ExitStack() as stack:
            # Held for its ranks: they keep the lock file open, so the lock lasts as long
            # as any of them runs, also after a launcher killed (SIGKILL) before them.
            fd = _lock_output(stack, output_path)
            code = launch_local(
                argv,
                nproc,
                gpu_ids=ids,
                log=lambda text: msg.fail(text),
                warn=msg.warn,
                pass_fds=() if fd is None else (fd,),
            )
        from ..training.stopping import ignore_ctrl_c

        ignore_ctrl_c()  # the ranks have ended: a Ctrl-C now would only change the exit code
        if code:
            sys.exit(code)
        return
    overrides = parse_config_overrides(ctx.args)
    import_code(code_path)
    train(
        config_path,
        output_path,
        gpu_ids=ids,
        overrides=overrides,
        resume=resume,
        timeout=timeout,
        max_padded_tokens=max_padded_tokens,
        dist_backend=dist_backend,
    )


def update_policy(nlp: Language, max_padded_tokens: Optional[int] = None) -> "UpdatePolicy":
    """The `UpdatePolicy` of a run: the one the config's `spacy-lean.lean_training.v1`
    callback installed on `nlp` (its ceiling, wordpiece lengths, checkpointing, parser
    gradient and heap trimming), else the defaults; `--max-padded-tokens`, when given,
    replaces the ceiling either way.

    nlp (Language): the initialized pipeline.
    max_padded_tokens (Optional[int]): the command line's ceiling.
    RETURNS (UpdatePolicy): the policy every update of the run uses.
    """
    from ..training.callbacks import get_update_policy
    from ..training.update import UpdatePolicy

    policy = get_update_policy(nlp) or UpdatePolicy()
    if max_padded_tokens is not None:
        UpdatePolicy(max_padded_tokens=max_padded_tokens)  # validates
        policy.max_padded_tokens = max_padded_tokens
    return policy


def _lock_output(stack: contextlib.ExitStack, output_path: Optional[Path]) -> Optional[int]:
    """Hold the lock on the run's --output (created if missing) until `stack` closes;
    fail with its message where another run holds it (see `training.output_lock`).
    RETURNS (Optional[int]): the lock file's descriptor, for the ranks to keep open."""
    from ..training.output_lock import OutputInUseError, output_lock

    existed = output_path is None or Path(output_path).exists()
    try:
        fd = stack.enter_context(output_lock(output_path))
    except OutputInUseError as err:
        Printer().fail(str(err), exits=1)
    if not existed:
        Printer().good(f"Created output directory: {output_path}")
    return fd


def train(
    config_path: Path,
    output_path: Optional[Path] = None,
    *,
    gpu_ids: List[int] = (),  # type: ignore[assignment]
    overrides: Dict = util.SimpleFrozenDict(),
    resume: bool = False,
    timeout: float = 600.0,
    max_padded_tokens: Optional[int] = None,
    dist_backend: str = "auto",
) -> None:
    """Run this process's rank of a training run (the rank comes from RANK/WORLD_SIZE).
    Rank 0 holds the lock on output_path while it runs (the launcher of `--nproc N`
    holds it for its ranks): a second run given the same folder is refused.

    config_path (Path): the training config.
    output_path (Optional[Path]): where rank 0 writes.
    gpu_ids (List[int]): GPUs by local rank; empty for the CPU.
    overrides (dict): config overrides.
    resume (bool): continue from output_path/training-state.
    timeout (float): collective timeout in seconds.
    max_padded_tokens (Optional[int]): see `spacy_lean.training.update.UpdatePolicy`.
    dist_backend (str): "auto", "nccl" or "gloo" (see `context_from_env`).
    """
    from ..training.launch import launched_by_us

    try:  # a bad RANK is refused by context_from_env, with its message
        rank = int(os.environ.get("RANK", "0"))
    except ValueError:
        rank = -1
    writes = rank == 0 and not launched_by_us()
    with contextlib.ExitStack() as stack:
        if writes:
            _lock_output(stack, output_path)
        _train_rank(
            config_path,
            output_path,
            gpu_ids=gpu_ids,
            overrides=overrides,
            resume=resume,
            timeout=timeout,
            max_padded_tokens=max_padded_tokens,
            dist_backend=dist_backend,
        )


def _train_rank(
    config_path: Path,
    output_path: Optional[Path],
    *,
    gpu_ids: List[int],
    overrides: Dict,
    resume: bool,
    timeout: float,
    max_padded_tokens: Optional[int],
    dist_backend: str,
) -> None:
    """`train` in this process, the output folder locked where this rank writes."""
    from spacy.training.initialize import init_nlp

    from ..corpus.docbin import CorruptShardError
    from ..training.dist import TrainingStateError, context_from_env
    from ..training.launch import launched_by_us, report_failure, stop_with_launcher
    from ..training.loop import DIR_STATE, LabelsGrewError, NothingToTrainError, check_steps_left
    from ..training.loop import read_training_state
    from ..training.loop import train as train_nlp
    from ..training.stopping import STOPPED_EXIT_CODE, TrainingStopped, ignore_ctrl_c, signal_name

    if launched_by_us():
        stop_with_launcher()  # a launcher that dies stops its ranks (after a checkpoint)
    try:
        dctx = context_from_env(gpu_ids, timeout_s=timeout, backend=dist_backend)
    except ValueError as err:
        Printer().fail(str(err), exits=1)
    msg = Printer(no_print=not dctx.is_main)
    if not dctx.is_main:
        _name_rank_in_warnings(dctx.rank, dctx.world_size)
        _name_rank_in_logs(dctx.rank, dctx.world_size)
    config_path = util.ensure_path(config_path)
    output_path = util.ensure_path(output_path)
    if output_path is None:
        msg.info("No output directory provided")
    elif dctx.is_main:
        if not output_path.exists():
            output_path.mkdir(parents=True)
            msg.good(f"Created output directory: {output_path}")
        msg.info(f"Saving to output directory: {output_path}")
    try:
        setup_gpu(dctx.gpu_id, silent=not dctx.is_main)
    except ValueError as err:  # thinc's require_gpu: no cupy, or no GPU visible
        _fail(msg, f"GPU {dctx.gpu_id}: {err}. {GPU_FIX}", dctx)
    with show_validation_error(config_path):
        config = util.load_config(config_path, overrides=overrides, interpolate=False)
    state = None
    if resume:
        try:
            state = read_training_state(output_path)
        except (FileNotFoundError, ValueError) as err:
            _fail(msg, str(err), dctx)
        saved_model = Path(state["path"]) / "model"
        msg.divider("Loading the saved pipeline")
        with show_validation_error(config_path, hint_fill=False):
            with _our_setting_errors(msg, config_path, dctx):
                nlp = _pipeline_to_resume(config, dctx.gpu_id)
        try:
            nlp.from_disk(saved_model, exclude=["config"])
        except Exception as err:
            _fail(msg, _saved_model_error(saved_model, config_path, err), dctx)
        msg.good(f"Loaded {saved_model} (step {state['step']})")
        try:
            training = nlp.config["training"]
            check_steps_left(state, training["max_steps"], training["max_epochs"])
        except ValueError as err:
            _fail(msg, str(err), dctx)
    else:
        msg.divider("Initializing pipeline")
        try:
            with show_validation_error(config_path, hint_fill=False), _single_process_view():
                with _our_setting_errors(msg, config_path, dctx):
                    nlp = init_nlp(config, use_gpu=dctx.gpu_id)
        except CorruptShardError as err:  # a data file: its message names it and the fix
            _fail(msg, str(err), dctx)
        msg.good("Initialized pipeline")
    try:
        policy = update_policy(nlp, max_padded_tokens)
    except ValueError as err:
        _fail(msg, str(err), dctx)
    msg.divider("Training pipeline")
    try:
        dctx.init()
        train_nlp(
            nlp,
            output_path,
            ctx=dctx,
            resume=state,
            policy=policy,
            stdout=sys.stdout if dctx.is_main else open(os.devnull, "w"),
            stderr=sys.stderr,
        )
    except (
        TrainingStateError,
        NothingToTrainError,
        LabelsGrewError,
    ) as err:  # every rank; rank 0 says it
        _fail(msg, str(err), dctx)
    except TrainingStopped as stop:  # every rank, after the same step; rank 0 says it
        ignore_ctrl_c()  # saved: nothing is left to stop
        if output_path is None:
            saved = "Nothing was saved (no --output)."
        else:
            saved = (
                f"The training state of that step is saved in {output_path / DIR_STATE}: "
                "continue with the same command and --resume."
            )
        msg.warn(f"Stopped by {signal_name(stop.signum)} after step {stop.step}. {saved}")
        sys.exit(STOPPED_EXIT_CODE)
    except CorruptShardError as err:
        if not dctx.active:  # one process: the message, which names the file, is enough
            _fail(msg, str(err), dctx)
        report_failure(dctx.rank)
        Printer().fail(f"Rank {dctx.rank} of {dctx.world_size} stopped: {err}", exits=1)
    except Exception as err:
        if dctx.active:
            report_failure(dctx.rank)  # first: the launcher blames the first to fail
            traceback.print_exc()
            Printer().fail(
                f"Rank {dctx.rank} of {dctx.world_size} stopped: {type(err).__name__}: {err}. "
                "If another rank died first, its own message above names the cause.",
                exits=1,
            )
        raise
    finally:
        dctx.close()
