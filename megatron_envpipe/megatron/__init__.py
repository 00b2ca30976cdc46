"""Layer 4, the torch + Megatron-core edge.

``patch.install()`` routes Megatron-core's pipeline schedule to ``executor``
(an instruction loop dispatching through a handler table over per-direction
P2P ``channels``); ``runtime`` runs the phases (measure or profile, plan,
reconfigure); ``compat`` absorbs megatron-core 0.16/0.19 differences and the
CPU/gloo shims; ``pretrain_gpt`` is the Megatron-LM entry point.
"""
