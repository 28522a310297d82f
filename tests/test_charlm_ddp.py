"""Character-LM training with DistributedDataParallel: 2 CPU processes (gloo),
started with torch.multiprocessing, and with torchrun through the CLI (slow)."""

import os
import signal
import subprocess
import sys
import uuid

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from spacy_lean.charlm.train import STATE_FILE, train_charlm

# Dropout off, so that 2 workers x 4 streams compute the same gradients as 1 x 8.
TINY = dict(
    hidden_size=32,
    embedding_size=16,
    bptt=30,
    lr=5.0,
    dropout=0.0,
    max_epochs=2,
    log_every=10,
    checkpoint_every=30,
    gpu_id=-1,
    progress=False,
)

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    # Imported here, not at module level: the spawned workers import this module,
    # and need neither spaCy nor the generator.
    from spacy_lean import synthetic

    path = tmp_path_factory.mktemp("charlm_ddp_text") / "train.txt"
    path.write_text("\n".join(synthetic.generated_sentences(300, seed=12)) + "\n", encoding="utf8")
    dev = path.parent / "dev.txt"
    dev.write_text("\n".join(synthetic.generated_sentences(40, seed=13)) + "\n", encoding="utf8")
    return path


@pytest.fixture(scope="module")
def dev_file(text_file):
    return text_file.parent / "dev.txt"


def _worker(rank, world_size, store, text_file, output_dir, kwargs, result_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    # ("sigterm_at": (rank, step)): that rank sends itself SIGTERM in that optimizer step.
    term_rank, term_step = kwargs.pop("sigterm_at", (-1, -1))
    if rank == term_rank:
        real_step, calls = torch.optim.SGD.step, []

        def step(self, *args, **kw):
            calls.append(1)
            if len(calls) == term_step:
                os.kill(os.getpid(), signal.SIGTERM)
            return real_step(self, *args, **kw)

        torch.optim.SGD.step = step
    try:
        result = train_charlm([text_file], output_dir, **kwargs)
        torch.save(
            {
                "state_dict": result.model.state_dict(),
                "losses": result.losses,
                "step": result.step,
                "stopped_by": result.stopped_by,
            },
            os.path.join(result_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.barrier()  # no worker tears gloo down while another still uses it
        dist.destroy_process_group()


def _train_ddp(tmp_path, text_file, output_dir, world_size=2, **kwargs):
    """Train with `world_size` gloo processes; RETURNS one result dict per rank."""
    result_dir = tmp_path / f"results-{uuid.uuid4().hex[:8]}"
    result_dir.mkdir()
    store = tmp_path / f"store-{uuid.uuid4().hex[:8]}"
    mp.spawn(
        _worker,
        args=(
            world_size,
            str(store),
            str(text_file),
            str(output_dir),
            {**TINY, **kwargs},
            str(result_dir),
        ),
        nprocs=world_size,
        join=True,
    )
    return [torch.load(result_dir / f"rank{r}.pt", weights_only=True) for r in range(world_size)]


def _max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _identical(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def reference(text_file, dev_file, tmp_path_factory):
    """One process reading all 8 streams for 60 steps."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = tmp_path_factory.mktemp("charlm_ddp_ref")
        return train_charlm(
            [text_file], out, batch_size=8, max_steps=60, dev_texts=[dev_file], **TINY
        )
    finally:
        torch.set_num_threads(before)


def test_ddp_two_workers_then_one(tmp_path, text_file, dev_file, reference, one_torch_thread):
    """2 gloo workers x 4 streams: identical weights on both ranks, the loss falls,
    and the steps equal one process's with 8 streams (up to float rounding), the dev
    loss too (each worker evaluates its share). The checkpoint then resumes on 1 worker
    (8 streams) and ends where the reference does."""
    a, b = _train_ddp(
        tmp_path, text_file, tmp_path / "run", batch_size=4, max_steps=30, dev_texts=[str(dev_file)]
    )
    assert a["step"] == b["step"] == 30
    assert _identical(a["state_dict"], b["state_dict"])
    assert a["losses"] == b["losses"]  # averaged over the workers
    assert a["losses"][-1][1] < a["losses"][0][1] - 0.15, a["losses"]
    for (step, mine), (ref_step, ref) in zip(a["losses"], reference.losses):
        assert step == ref_step and abs(mine - ref) < 1e-4
    state = torch.load(tmp_path / "run" / STATE_FILE, weights_only=True)
    ((dev_step, dev_loss),) = state["dev_losses"]
    assert dev_step == reference.dev_losses[0][0] == 30
    assert abs(dev_loss - reference.dev_losses[0][1]) < 1e-4
    assert state["world_size"] == 2 and state["loader"]["n_streams"] == 8
    assert state["hidden"][0].shape == (1, 8, 32)  # the hidden states of all streams
    resumed = train_charlm([text_file], tmp_path / "run", resume=True, max_steps=60, **TINY)
    assert resumed.step == 60
    assert _max_diff(resumed.model.state_dict(), reference.model.state_dict()) < 1e-4
    assert resumed.losses[-1][1] < resumed.losses[0][1] - 0.3


def test_ddp_resumes_a_single_worker_checkpoint_on_two(
    tmp_path, text_file, reference, one_torch_thread
):
    train_charlm([text_file], tmp_path / "run", batch_size=8, max_steps=30, **TINY)
    a, b = _train_ddp(tmp_path, text_file, tmp_path / "run", resume=True, max_steps=60)
    assert a["step"] == b["step"] == 60
    assert _identical(a["state_dict"], b["state_dict"])
    assert _max_diff(a["state_dict"], reference.model.state_dict()) < 1e-4


@pytest.mark.slow
def test_torchrun_cli(tmp_path, text_file):
    """`torchrun --nproc_per_node 2 -m spacy lean train-charlm ...` on CPU (gloo)."""
    out = tmp_path / "torchrun"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "localhost:0",
        "-m",
        "spacy",
        "lean",
        "train-charlm",
        str(text_file),
        str(out),
        "--hidden-size",
        "16",
        "--embedding-size",
        "8",
        "--bptt",
        "20",
        "-b",
        "4",
        "--max-steps",
        "30",
        "--gpu-id",
        "-1",
        "--threads",
        "1",
        "--log-every",
        "10",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 workers" in proc.stdout
    state = torch.load(out / STATE_FILE, weights_only=True)
    assert state["step"] == 30 and state["world_size"] == 2


def test_sigterm_to_one_worker_stops_both_after_the_same_step_saved(
    tmp_path, text_file, reference, one_torch_thread
):
    """Rank 1 alone gets SIGTERM, in step 33: the workers agree at the next loss report
    (every 10 steps), both stop after step 40 with it saved, and the run resumes on one
    worker (8 streams) to the reference's weights."""
    a, b = _train_ddp(
        tmp_path, text_file, tmp_path / "run", batch_size=4, max_steps=60, sigterm_at=(1, 33)
    )
    assert a["step"] == b["step"] == 40
    assert a["stopped_by"] == b["stopped_by"] == signal.SIGTERM
    assert _identical(a["state_dict"], b["state_dict"])
    assert torch.load(tmp_path / "run" / STATE_FILE, weights_only=True)["step"] == 40
    resumed = train_charlm([text_file], tmp_path / "run", resume=True, max_steps=60, **TINY)
    assert resumed.step == 60 and resumed.stopped_by is None
    assert _max_diff(resumed.model.state_dict(), reference.model.state_dict()) < 1e-4
