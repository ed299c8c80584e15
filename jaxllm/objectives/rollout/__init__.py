"""Objectives on batches the policy samples itself: GRPO (`grpo`), PPO (`ppo`) and online DPO
(`online_dpo`).

`sampling.Rollouts` stands where the data pipeline's iterator stands in the train loop: it draws
prompts, samples completions with the jitted generator from the state's own parameters, scores
them (`rewards`: verifiable reward functions of the texts, or a reward model held on the mesh)
and lays them out as the step's rows with their advantages and old log-probabilities.
`onpolicy.OnPolicyDistill` samples with the same generator for on-policy distillation (GKD).
"""
