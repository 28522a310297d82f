"""Refuse, before training starts, a mixed-precision run without a GPU.

spacy-transformers' `mixed_precision = true` trains on a CUDA GPU only: on the CPU,
`spacy train` initialises the whole pipeline and then fails at the first update, deep in
thinc's gradient scaler ("Gradient scaling is not supported, requires capable GPU"),
naming neither the setting nor the fix. (`spacy lean train` refuses it itself, before
its first update; this check serves both training steps with the project's var names.)
"""

from typing import List

import typer
from wasabi import msg

from spacy_lean.cli.train import parse_gpu_ids


def _gpu_ids(value: str) -> List[int]:
    """The GPU ids as `spacy lean train --gpu-ids` reads them (so '-1,1' is refused
    here as it is there, not taken for GPU 1)."""
    try:
        return parse_gpu_ids(value)
    except ValueError as err:
        msg.fail(str(err), exits=1)


def main(
    mixed_precision: str = typer.Option(..., "--mixed-precision", help="${vars.mixed_precision}"),
    gpu_ids: str = typer.Option(..., "--gpu-ids", help="${vars.gpu_id} or ${vars.gpu_ids}"),
    var: str = typer.Option("gpu_id", "--var", help="the var naming the GPU(s), for the message"),
):
    """Exit with 1 and the fix when mixed precision is on and no GPU is given."""
    flag = mixed_precision.strip().lower()
    if flag not in ("true", "false"):
        msg.fail(f"--vars.mixed_precision must be true or false, got '{mixed_precision}'", exits=1)
    ids = _gpu_ids(gpu_ids)  # read (and refused) as spacy lean train reads them
    if flag == "true" and not ids:
        example = "0" if var == "gpu_id" else "0,1"
        msg.fail(
            "--vars.mixed_precision true needs a GPU (float16 and gradient scaling run on "
            f"CUDA only), but --vars.{var} is {gpu_ids}: the run would fail at its first "
            f"update. Pass --vars.{var} {example}, or leave mixed_precision false.",
            exits=1,
        )


if __name__ == "__main__":
    typer.run(main)
