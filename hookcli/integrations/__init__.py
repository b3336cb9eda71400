"""Native callbacks for the training loops people already use, over the public ``hookcli.watch``.

``hookcli.integrations.lightning.HookcliCallback``: a Lightning ``Callback``;
``hookcli.integrations.transformers.HookcliTrainerCallback``: a Hugging Face ``TrainerCallback``.
Each gives the log, the rules and the stderr lines of ``hookcli watch -- CMD`` (docs/integrations.md).
Importing this package imports neither torch nor the training library; each submodule imports its
own library, and a missing one is an ImportError naming the extra to install.
"""
