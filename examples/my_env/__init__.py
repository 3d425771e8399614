"""A user's own environment, in a package of its own outside the project's envs/ (docs/your_env.md walks through it).

    .venv/bin/python scripts/launch.py env.name=examples.my_env.guess:GuessEnv      # by import path
    .venv/bin/python scripts/launch.py env.name=examples.my_env:my_env/Guess-v0     # by the gymnasium id below

Importing the package registers its env with gymnasium, as a published env package would; gymnasium's
`module:id` form (`examples.my_env:my_env/Guess-v0`) imports it before looking the id up.
"""

import gymnasium as gym

if "my_env/Guess-v0" not in gym.registry:
    gym.register(id="my_env/Guess-v0", entry_point="examples.my_env.guess:GuessEnv")
