"""kvedge as a LiteLLM routing strategy.

LiteLLM's Router picks one of a model's deployments for each call; with
this strategy kvedge picks it, so prefix-cache locality and the engines'
load decide::

    from litellm import Router
    from litellm_strategy import KvedgeRoutingStrategy

    router = Router(model_list=[
        {"model_name": "llama", "litellm_params": {"model": "openai/llama", "api_base": "http://10.0.0.5:8000/v1", "api_key": "-"}},
        {"model_name": "llama", "litellm_params": {"model": "openai/llama", "api_base": "http://10.0.0.6:8000/v1", "api_key": "-"}},
    ])
    router.set_custom_routing_strategy(KvedgeRoutingStrategy(router, "/run/kvedge"))

A deployment is the worker whose registered endpoint equals its
``api_base`` (a trailing ``/v1`` or ``/`` aside). kvedge's model name is the
deployment group's ``model_name`` unless ``model_info.kvedge_model`` says
otherwise. The select is a dry run: LiteLLM has no per-request hook here to
report prefill_done and finish, so the engines' own load reports carry the
requests in flight. Prompts are tokenized as in openai_proxy.py (give the
model's tokenizer for prefix routing).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from litellm.router import CustomRoutingStrategyBase

import kvedge
from openai_proxy import byte_tokens


def _base(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


class KvedgeRoutingStrategy(CustomRoutingStrategyBase):
    def __init__(
        self,
        router: Any,
        runtime_dir: str = kvedge.DEFAULT_RUNTIME_DIR,
        tokenize: Callable[[str], List[int]] = byte_tokens,
    ) -> None:
        self.router = router
        self.client = kvedge.AsyncClient(runtime_dir, rings=True)
        self.tokenize = tokenize

    def _deployments(self, model: str) -> List[Dict[str, Any]]:
        registry = getattr(self.router, "registry", None)
        every = registry().all() if callable(registry) else self.router.model_list
        return [d for d in every if d.get("model_name") == model]

    def _tokens(self, messages: Optional[List[Dict[str, str]]], input: Any) -> List[int]:
        if messages:
            return self.tokenize("".join(f"<|{m.get('role', '')}|>{m.get('content', '')}" for m in messages))
        return self.tokenize(str(input or ""))

    # LiteLLM's base class declares these as returning None, while its
    # Router uses the deployment a custom strategy returns.
    async def async_get_available_deployment(  # type: ignore[override]
        self,
        model: str,
        messages: Optional[List[Dict[str, str]]] = None,
        input: Any = None,
        specific_deployment: Optional[bool] = False,
        request_kwargs: Optional[Dict[str, Any]] = None,
    ) -> Dict[str, Any]:
        deployments = self._deployments(model)
        if not deployments:
            raise ValueError(f"no deployment for model {model!r}")
        kvedge_model = (deployments[0].get("model_info") or {}).get("kvedge_model", model)
        choice = await self.client.select(kvedge_model, tokens=self._tokens(messages, input), dry_run=True)
        for d in deployments:
            if _base(d["litellm_params"].get("api_base", "")) == _base(choice.endpoint):
                return d
        raise kvedge.NoWorker(
            f"kvedge chose {choice.endpoint}, which no deployment of {model!r} has as its api_base"
        )

    def get_available_deployment(
        self,
        model: str,
        messages: Optional[List[Dict[str, str]]] = None,
        input: Any = None,
        specific_deployment: Optional[bool] = False,
        request_kwargs: Optional[Dict[str, Any]] = None,
    ) -> None:
        raise NotImplementedError("use the Router's async calls (acompletion)")
