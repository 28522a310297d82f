"""`spacy evaluate` and `spacy benchmark accuracy` in bounded memory, for pipelines
whose config names `spacy-lean.streaming_evaluate.v1`.

spaCy's command lists the whole dev corpus (`list(corpus(nlp))`) before it calls
`nlp.evaluate`, so even a pipeline that evaluates streaming holds every reference doc.
Importing `spacy_lean.cli` (spaCy does it at start-up, through the `spacy_cli` entry
point, after its own commands are registered) wraps the callback of every command that
runs spaCy's `evaluate_cli`. The wrapper runs spaCy's own command unchanged, with one
thing swapped for the length of the call: the `Corpus` it builds the dev set with.
That corpus asks the loaded pipeline whether it evaluates streaming (`is_streaming`):

- no: it is spaCy's `Corpus`, so the command reads, computes and prints exactly what it
  did before;
- yes: the listed dev set holds only the examples displaCy renders (the first
  `--displacy-limit` with `--displacy-path`, else none), and the pipeline's streaming
  `nlp.evaluate` is given those followed by the rest of the data, read lazily with
  spacy-lean's reader. spaCy's code prints the table, writes `--output` and renders
  displaCy as before, from the same scores.
"""

import functools
import importlib
import inspect
import itertools
import types
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Union

from spacy.language import Language
from spacy.training import Corpus, Example
from spacy.training.corpus import FILE_TYPE, walk_corpus

from ..corpus import CorruptShardError, read_examples
from ..corpus.sources import check_regular_file
from ..streaming import is_streaming

# `spacy.cli.evaluate` the attribute is the function; the module is in sys.modules.
spacy_evaluate_module = importlib.import_module("spacy.cli.evaluate")
_SIGNATURE = inspect.signature(spacy_evaluate_module.evaluate)


class StreamingDevCorpus:
    """The dev corpus `spacy evaluate` builds while the wrapper is active: spaCy's
    `Corpus` for a pipeline that does not evaluate streaming; for one that does, the
    examples displaCy needs now and the rest streamed into `nlp.evaluate`.

    path (Union[str, Path]): the evaluation data (a .spacy file or a folder).
    gold_preproc (bool): as `spacy.Corpus`.
    keep (Optional[int]): examples the command uses after `nlp.evaluate` (for
        displaCy); None: the command needs them all, so nothing streams.
    """

    def __init__(
        self, path: Union[str, Path], *, gold_preproc: bool = False, keep: Optional[int] = 0
    ):
        self.path = path
        self.gold_preproc = gold_preproc
        self.keep = keep
        self.stock = Corpus(path, gold_preproc=gold_preproc)

    def __call__(self, nlp: Language) -> Iterator[Example]:
        if self.keep is None or not is_streaming(nlp):
            return self.stock(nlp)
        return self._stream(nlp)

    def _stream(self, nlp: Language) -> Iterator[Example]:
        # The same files, in the same order, as spaCy's Corpus reads (W090 if none).
        files = walk_corpus(self.path, FILE_TYPE)
        for file_ in files:
            try:
                check_regular_file(Path(file_), self.path)
            except ValueError as err:  # said as an unreadable data file is
                raise CorruptShardError(str(err)) from None
        examples = read_examples(nlp, files, gold_preproc=self.gold_preproc)
        kept = list(itertools.islice(examples, self.keep))
        _evaluate_rest_next(nlp, kept, examples)
        yield from kept


def _evaluate_rest_next(nlp: Language, kept: List[Example], rest: Iterator[Example]) -> None:
    """Make the next `nlp.evaluate(kept)` evaluate `kept` followed by `rest`, with the
    pipeline's streaming method, which is then put back."""
    streaming = nlp.__dict__["evaluate"]

    def evaluate_with_rest(self: Language, examples, **kwargs) -> Dict[str, Any]:
        nlp.evaluate = streaming  # type: ignore[method-assign]
        examples = list(examples)
        if len(examples) != len(kept) or any(a is not b for a, b in zip(examples, kept)):
            raise RuntimeError(
                "spacy-lean's streaming `spacy evaluate` expected spaCy's command to pass "
                "the dev set it listed to nlp.evaluate, but it passed other examples: this "
                "spaCy version's `spacy.cli.evaluate` works differently. Please report it "
                "with your spaCy version; meanwhile use `python -m spacy lean evaluate`."
            )
        return streaming(_KeptThenRest(examples, rest), **kwargs)

    nlp.evaluate = types.MethodType(evaluate_with_rest, nlp)  # type: ignore[method-assign]


class _KeptThenRest:
    """The listed examples, then the rest of the stream; holds docs only where the
    stream does (the listed ones were made before the evaluation, outside its memory
    zones, and may be used in any of them)."""

    def __init__(self, kept: List[Example], rest: Iterator[Example]) -> None:
        self._iter = itertools.chain(kept, rest)
        self._rest = rest

    def __iter__(self) -> "_KeptThenRest":
        return self

    def __next__(self) -> Example:
        return next(self._iter)

    def holds_docs(self) -> bool:
        holds = getattr(self._rest, "holds_docs", None)
        return holds() if callable(holds) else True

    def use_memory_zones(self) -> None:
        use = getattr(self._rest, "use_memory_zones", None)
        if callable(use):
            use()


def displacy_keep(displacy_path: Optional[Union[str, Path]], displacy_limit: int) -> Optional[int]:
    """How many of the listed examples `spacy evaluate` uses after evaluating: its
    displaCy sample (`dev_dataset[:displacy_limit]`), none without `--displacy-path`.
    None (keep all) for a negative limit, which slices from the end."""
    if not displacy_path:
        return 0
    return displacy_limit if displacy_limit >= 0 else None


@contextmanager
def streaming_dev_corpus(keep: Optional[int]) -> Iterator[None]:
    """While active, spaCy's `evaluate` builds its dev corpus as `StreamingDevCorpus`."""
    previous = spacy_evaluate_module.Corpus
    spacy_evaluate_module.Corpus = functools.partial(StreamingDevCorpus, keep=keep)
    try:
        yield
    finally:
        spacy_evaluate_module.Corpus = previous


def evaluate(*args: Any, **kwargs: Any) -> Dict[str, Any]:
    """spaCy's `spacy.cli.evaluate.evaluate` (same arguments, output and result), in
    bounded memory when the loaded pipeline evaluates streaming.

    RETURNS (Dict[str, Any]): what spaCy's function returns.
    """
    bound = _SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    keep = displacy_keep(bound.arguments["displacy_path"], bound.arguments["displacy_limit"])
    with streaming_dev_corpus(keep):
        return spacy_evaluate_module.evaluate(*args, **kwargs)


def _wrap_command(stock: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(stock)

    @functools.wraps(stock)  # typer reads the options and help through __wrapped__
    def evaluate_cli(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        keep = displacy_keep(bound.arguments["displacy_path"], bound.arguments["displacy_limit"])
        with streaming_dev_corpus(keep):
            try:
                return stock(*args, **kwargs)
            except CorruptShardError as err:
                # Raised by spacy-lean's reader (streaming pipelines only): its message
                # names the file and the fix, which a traceback would bury. spaCy's
                # own errors (a pipeline that does not stream) are left as they are.
                from wasabi import msg

                msg.fail("Could not read the evaluation data", str(err), exits=1)

    return evaluate_cli


def install(app: Any = None) -> List[str]:
    """Wrap every command of spaCy's CLI app (sub-apps included) that runs spaCy's
    `evaluate_cli`: `spacy evaluate` and `spacy benchmark accuracy`. Idempotent.

    app (typer.Typer): the app; defaults to spaCy's.
    RETURNS (List[str]): the wrapped commands' names, e.g. ["evaluate", "benchmark accuracy"].
    """
    if app is None:
        from spacy.cli._util import app
    stock = spacy_evaluate_module.evaluate_cli
    wrapped = []

    def visit(typer_app: Any, prefix: str) -> None:
        for info in typer_app.registered_commands:
            callback = info.callback
            if callback is stock or getattr(callback, "__wrapped__", None) is stock:
                if callback is stock:
                    info.callback = _wrap_command(stock)
                wrapped.append(prefix + (info.name or stock.__name__))
        for group in typer_app.registered_groups:
            name = group.name or getattr(group.typer_instance.info, "name", None) or ""
            visit(group.typer_instance, f"{prefix}{name} ")

    visit(app, "")
    return wrapped
