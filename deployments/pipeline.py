"""The deployment of a composed model (``pipeline:`` in its config): its steps are other models."""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
from ray import serve

from .client import ModelClient
from .loopback import replica_grpc_on_loopback
from .logs import show_on_terminal
from .observe.deployment import observed_steps
from .pipelines import create_pipeline
from .runtime.contract.repository import ModelRepository
from .runtime.contract.validation import validate_request


@serve.deployment
class PipelineDeployment:
    """A composed model (like a Triton ensemble) whose steps call other model deployments.

    It validates the pipeline model's own request (the steps' replicas validate theirs).
    """

    def __init__(self, repository: str, name: str, dedicated: dict[str, Any], pool: Any | None,
                 pool_models: Iterable[str], metrics: dict[str, Any] | None = None) -> None:
        show_on_terminal()
        replica_grpc_on_loopback()
        repo = ModelRepository(repository)
        self.config = repo.get(name).config
        steps = observed_steps(ModelClient(dedicated, pool, pool_models).infer, metrics,
                               {e.name: str(e.latest) for e in repo.entries()})
        self.pipeline = create_pipeline(repo, name, steps)

    async def infer(self, inputs: dict[str, np.ndarray], outputs: list[str] | None = None) -> dict[str, np.ndarray]:
        """Run one request through the pipeline; returns the requested outputs by name.

        Raises:
            InvalidInput: the inputs or requested outputs do not fit the pipeline model's config.
        """
        wanted = validate_request(self.config, inputs, outputs)
        result = await self.pipeline.infer(inputs)
        return result if outputs is None else {n: result[n] for n in wanted}

    def backend(self) -> str:
        """``pipeline`` (see ``ModelDeployment.backend``)."""
        return "pipeline"
