"""The error of a call to an inference server, below the clients and what they use."""

from __future__ import annotations

from typing import Optional


class InferenceServerError(RuntimeError):
    def __init__(self, address: str, endpoint: str, message: str, status: Optional[int] = None):
        super().__init__(f"inference server {address}{endpoint}: {message}")
        self.address, self.endpoint, self.status = address, endpoint, status
