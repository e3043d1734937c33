"""Hub ids on the command line, checked before a loader retries for a minute: a model or dataset id must be in the
local cache or answer one request, so a typo, a private repo without a token or no network is one line naming the
fix."""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError


class HubError(UserError, RuntimeError):
    """A push or card problem, with a one-line message naming the fix."""


def check_hub_model(repo_id: str, what: str = "model", filename: str = "config.json",
                    repo_type: str = "model") -> None:
    """Before a loader retries for a minute: a Hub id must be in the local cache or answer one request.

    A typo, a private repo without a token or no network then ends in one line naming the fix. Offline
    (HF_HUB_OFFLINE) the loader is left to its cache.
    """
    from huggingface_hub import constants, repo_info, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if constants.HF_HUB_OFFLINE or isinstance(try_to_load_from_cache(repo_id, filename, repo_type=repo_type), str):
        return
    try:
        repo_info(repo_id, repo_type=repo_type, timeout=10)
    except GatedRepoError:
        raise HubError(f"{what} {repo_id!r} is gated; accept its terms on the Hub and log in (`hf auth login`)") from None
    except RepositoryNotFoundError:
        raise HubError(f"{what} {repo_id!r} is no local path and no Hub repo you can read; check the spelling "
                       "(a local path must exist) or log in for a private repo (`hf auth login`)") from None
    except Exception as e:  # no network, DNS, proxy, timeout
        raise HubError(f"{what} {repo_id!r} is no local path and the Hub cannot be reached ({one_line(e)}); "
                       "pass a local path, check the network, or set HF_HUB_OFFLINE=1 to use the cache") from None


def check_dataset(spec: str | None, builtin: str = "builtin") -> None:
    """``--dataset``: ``builtin``, an existing local path, or a Hub dataset id that answers (see ``check_hub_model``)."""
    if not spec or spec == builtin or Path(spec).expanduser().exists():
        return
    if spec.startswith((".", "/", "~")) or Path(spec.split("/")[0]).is_dir() or spec.count("/") > 1:
        raise HubError(f"dataset {spec!r} not found; pass an existing folder or file, a Hub dataset id, or builtin")
    check_hub_model(spec, "dataset", filename="README.md", repo_type="dataset")


def one_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")



__all__ = ["HubError", "check_dataset", "check_hub_model", "one_line"]
