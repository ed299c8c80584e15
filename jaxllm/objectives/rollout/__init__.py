"""Objectives on batches the policy samples itself: the critic-free family (`grpo`: GRPO and its
presets dr_grpo / dapo / gspo, RLOO, REINFORCE++; their advantages in `advantages`, their
batch fields in `critic_free`) PPO (`ppo`) and online DPO (`online_dpo`).

`sampling.Rollouts` stands where the data pipeline's iterator stands in the train loop: it draws
prompts, samples completions with the jitted generator from the state's own parameters
(`generation`), scores them (`rewards`: verifiable reward functions of the texts, or a reward
model held on the mesh) and lays them out as the step's rows with their advantages and old
log-probabilities. `onpolicy.OnPolicyDistill` samples with the same generator for on-policy
distillation (GKD).
"""
