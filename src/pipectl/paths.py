"""Where pipectl finds its shipped configuration files (`configs/`), a user's model factory and a
Hugging Face model directory."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pipectl.errors import UserInputError


def configs_dir() -> Path:
    """The `configs/` folder: `$PIPECTL_CONFIGS`, else the copy an installed wheel carries
    (`pipectl/_configs`), else the one beside the source tree (a checkout or an editable install)."""
    override = os.environ.get("PIPECTL_CONFIGS")
    if override:
        return Path(override)
    packaged = Path(__file__).resolve().parent / "_configs"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[2] / "configs"


def given_file(text: str | os.PathLike[str]) -> Path | None:
    """The absolute path of a file the user named by path, else None (a shipped name, a reference,
    a file that does not exist). Resolved once, when given: whatever reads it later may run in
    another directory (a rank in the run directory, a resume or resize anywhere)."""
    path = Path(text)
    return path.resolve() if path.is_file() else None


def resolve_config(name_or_path: str | os.PathLike[str], kind: str) -> Path:
    """A YAML file given by path, or by a shipped name (`gpt-tiny` -> configs/models/gpt-tiny.yaml).

    `kind` is the sub-folder of `configs/`: "models" or "clusters".
    """
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = configs_dir() / kind / f"{name_or_path}.yaml"
    if shipped.is_file():
        return shipped
    known = sorted(p.stem for p in (configs_dir() / kind).glob("*.yaml"))
    raise UserInputError(
        f"{kind[:-1]} '{name_or_path}' is neither a file nor a shipped name",
        hint=f"shipped {kind}: {', '.join(known) or '(none)'}",
    )


# Set for every rank from the job's `import_root`: the folder the run was first launched from, where
# a user's model or dataset factory (`package.module:function`) is imported from (ranks run inside
# the run directory; a resume or resize may run anywhere).
MODEL_PATH_VARIABLE = "PIPECTL_MODEL_PATH"


def factory_search_path() -> list[str]:
    """The launch folder (if any), then the current directory, as `python -m` would use."""
    folders = [os.environ[MODEL_PATH_VARIABLE]] if os.environ.get(MODEL_PATH_VARIABLE) else []
    folders.append(os.getcwd())
    return list(dict.fromkeys(folders))


@contextmanager
def import_root(folder: str | os.PathLike[str] | None) -> Iterator[None]:
    """Resolve factories from `folder`, as a rank of a job launched from there does (the rank's
    `PIPECTL_MODEL_PATH`); None changes nothing. The launch pre-flight builds the model and the
    dataset under it, so that what passes here is what the ranks will import."""
    if folder is None:
        yield
        return
    before = os.environ.get(MODEL_PATH_VARIABLE)
    os.environ[MODEL_PATH_VARIABLE] = str(folder)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(MODEL_PATH_VARIABLE, None)
        else:
            os.environ[MODEL_PATH_VARIABLE] = before


# How a factory is named, for a hint that holds from any folder (examples/ is only in a checkout).
FACTORY_FORM = ("write it as package.module:function, the module importable from the folder you run in "
                "(docs/guide/models-and-data.md; examples/ in pipectl's source holds two)")


def is_factory_reference(text: str) -> bool:
    """Whether `text` is written as `package.module:function` (dotted identifiers, a colon, an identifier).

        >>> is_factory_reference("mypkg.net:build"), is_factory_reference("../b/mypkg.net:build")
        (True, False)
    """
    module, sep, function = text.partition(":")
    return bool(sep and module) and function.isidentifier() and all(part.isidentifier() for part in module.split("."))


HF_PREFIX = "hf:"  # a Hugging Face model directory: hf:PATH (models/hf.py)
HF_CONFIG_FILE = "config.json"


def hf_model_dir(reference: str) -> Path:
    """`hf:PATH` -> the absolute directory holding config.json (PATH may name the file itself)."""
    path = Path(reference.removeprefix(HF_PREFIX)).expanduser()
    if path.name == HF_CONFIG_FILE:
        path = path.parent
    if not (path / HF_CONFIG_FILE).is_file():
        raise UserInputError(
            f"no Hugging Face config at {path / HF_CONFIG_FILE}", hint="hf:PATH names a directory holding config.json"
        )
    return path.resolve()


def stored_reference(reference: str) -> str:
    """The model reference to record in a profile, a plan or a job: a path made absolute once, when
    given (a Hugging Face directory, a YAML file), so that it names the same file from wherever it
    is read later (ranks run inside the run directory; `resize`, `launch --resume` and `status` run
    anywhere). A shipped name and a `package.module:factory` stay as given: the factory is
    imported from the job's `import_root`. A YAML file by path wins over a shipped name of the same
    spelling, as `resolve_config` has it.

        >>> stored_reference("gpt-tiny")
        'gpt-tiny'
    """
    if reference.startswith(HF_PREFIX):
        return HF_PREFIX + str(hf_model_dir(reference))
    path = given_file(reference)
    return reference if path is None else str(path)


HF_TOKENIZER_FILE = "tokenizer.json"


def hf_tokenizer_file(reference: str | None) -> str | None:
    """The tokenizer.json beside an `hf:` model's config, if it has one; None for other models."""
    if not reference or not reference.startswith(HF_PREFIX):
        return None
    path = hf_model_dir(reference) / HF_TOKENIZER_FILE
    return str(path) if path.is_file() else None
