"""RL post-training pieces apart from the Lightning stage (`glm_lightning.modules.rl.RLModule`): the pure maths
(`loss`), the grouped settings LightningCLI parses (`config`) and the rollout record with its logging (`rollouts`).
"""
