"""The ``patch`` subcommand of the ``hybridgemm`` command (registered by fusion/cli/commands.py
through :func:`add_patch_parser`):

    hybridgemm patch --dry-run --hf-config PATH [--strict]

What :func:`hybridgemm.patch` does to a model, without its weights: the model is built from its
Hugging Face ``config.json`` (or a local model directory holding one) on the meta device, so
no memory is allocated and nothing is fetched, then patched; the command prints the report's
summary and every skipped module with its reason (:class:`~hybridgemm.models.PatchReport`).
Patching reads only the modules' structure, so the report is the one the model with its
weights gets. ``--strict``: exit 1 when anything was skipped (what ``patch(strict=True)``
raises on). A bad path, config or model type raises ``ValueError`` with one line, which the
command prints on stderr with exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import warnings

import torch

from hybridgemm.autotune_cache.presets import read_hf_config, show_path
from hybridgemm.models.patching import PatchReport, patch


def add_patch_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("patch", help="what hybridgemm.patch does to a model, from its config.json alone "
                                            "(--dry-run: built on the meta device, no weights)")
    p.add_argument("--dry-run", action="store_true", required=True,
                   help="build the model without weights and print the report (patch real models in Python: "
                        "hybridgemm.patch(model))")
    p.add_argument("--hf-config", required=True, metavar="PATH",
                   help="a Hugging Face config.json, or a local model directory holding one")
    p.add_argument("--strict", action="store_true", help="exit 1 when a module was left unpatched or unfused")
    p.set_defaults(fn=cmd_patch)
    return p


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' warnings about a config's fields (token ids outside a vocabulary, ...) are
    not the report's business: errors only while the model is built."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def _one_line(e: BaseException, limit: int = 300) -> str:
    """``Type: message`` on one line (transformers' validation errors span several), cut short."""
    text = " ".join(str(e).split())
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def build_on_meta(path: str) -> tuple[str, torch.nn.Module]:
    """(the config file's path, the model transformers builds from it on the meta device): a
    causal LM where transformers has one for the config's ``model_type``, else its base model.
    One-line ``ValueError`` for a bad path or config, an unknown ``model_type``, or a config
    transformers cannot build."""
    file, raw = read_hf_config(path)
    if not isinstance(raw, dict):
        raise ValueError(f"{file}: expected a JSON object at the top level, got {type(raw).__name__}")
    try:
        import transformers
    except ImportError:
        raise ValueError("hybridgemm patch --dry-run needs transformers (pip install transformers)") from None
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"{file}: no model_type field: transformers cannot tell which model it configures")
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"{file}: model_type {model_type[:60]!r} is not one transformers {transformers.__version__} "
                         "knows (models with custom code are not built)")
    with _quiet_transformers(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            config = CONFIG_MAPPING[model_type].from_dict(raw)
        except Exception as e:  # noqa: BLE001 (transformers' checks raise several types: one line each)
            raise ValueError(f"{file}: transformers refuses this {model_type} config: {_one_line(e)}") from None
        for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
            try:
                with torch.device("meta"):
                    return file, auto.from_config(config)
            except ValueError as e:  # no such head for this config: the next one
                why = e
            except Exception as e:  # noqa: BLE001
                raise ValueError(f"{file}: transformers cannot build a {model_type} model from it: "
                                 f"{_one_line(e)}") from None
    raise ValueError(f"{file}: transformers has no model for model_type {model_type!r}: {_one_line(why)}")


def dry_run(path: str) -> tuple[str, torch.nn.Module, PatchReport]:
    """(config file, the patched meta model, the report) of :func:`hybridgemm.patch` on the model
    ``path`` configures."""
    file, model = build_on_meta(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "nothing patched": the summary says it
        try:
            report = patch(model)
        except Exception as e:  # noqa: BLE001 (a user-facing command: one line, not a traceback)
            raise ValueError(f"{file}: hybridgemm.patch failed on the {type(model).__name__} it configures: "
                             f"{_one_line(e)}") from None
    return file, model, report


def cmd_patch(args) -> int:
    file, model, report = dry_run(args.hf_config)
    print(f"{show_path(file)}: {type(model).__name__}, built on the meta device (no weights)")
    print(report.summary())
    if report.skipped:
        print(f"skipped ({len(report.skipped)}):")
        for line in report.skipped_lines():
            print(f"  {line}")
    return 1 if args.strict and report.skipped else 0


__all__ = ["add_patch_parser", "build_on_meta", "cmd_patch", "dry_run"]
