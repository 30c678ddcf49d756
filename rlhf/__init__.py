"""The library: tasks, models, SFT, reward models, PPO and its critic-free relatives with every KL variant.

Math and models only: no file I/O, no global configuration."""
