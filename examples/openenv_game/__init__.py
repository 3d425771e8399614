"""An OpenEnv environment (an `openenv-core` server), trained by the actors over its WebSocket sessions.

    .venv/bin/python scripts/launch.py env.name=agentstream/OpenEnv-v0 +env.kwargs.app=examples.openenv_game.server:app

docs/your_env.md#openenv-environments walks through it; envs/openenv.py is the adapter the actors play it with.
"""
