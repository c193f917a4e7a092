"""A model's answer: its output arrays by name, and the response-level ``parameters`` it adds."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import numpy as np


class Outputs(dict[str, np.ndarray]):
    """Output name -> array, as every ``infer`` returns, with ``parameters``: what the answer says
    besides its tensors (KServe v2's response ``parameters``), e.g. the embed pipeline's
    ``truncated`` texts. A plain dict answers with none; ``parameters_of`` reads either."""

    def __init__(self, arrays: Mapping[str, np.ndarray], parameters: Mapping[str, Any] | None = None) -> None:
        super().__init__(arrays)
        self.parameters: dict[str, Any] = dict(parameters or {})

    def select(self, names: Iterable[str]) -> "Outputs":
        """The outputs ``names`` (in that order), the parameters kept."""
        return Outputs({n: self[n] for n in names}, self.parameters)


def parameters_of(outputs: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """The response ``parameters`` of an answer (empty for a plain dict)."""
    return dict(getattr(outputs, "parameters", None) or {})
