"""The policies a config may name (``policy: flow | llm``) and how to load one. Its own module,
below both: the config validates ``policy`` against it and the trainer loads the class through
it, while the policies' shared code (``policy.py``) uses the config's types without the config
importing it back."""
from __future__ import annotations

from flowgrpo.dotted import import_dotted

# config.policy -> "module:Class"; imported on use, so the LM path never imports the flow stack.
POLICIES = {"flow": "flowgrpo.flow_policy:FlowPolicy", "llm": "flowgrpo.llm:LMPolicy"}


def load_policy_class(kind: str) -> type:
    """The policy class of ``config.policy`` (imported now)."""
    return import_dotted(POLICIES[kind], "policy")
