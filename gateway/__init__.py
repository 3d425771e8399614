"""The OpenAI-compatible gateway: existing agent code (a loop around the OpenAI API, with tools) plays training
episodes through it, and every call it makes becomes one transition at the broker, token-exact.

    server.py          Gateway: the aiohttp service (episodes, /v1/chat/completions, /v1/completions, /v1/models)
    __main__.py        `python -m gateway`: the process the launcher starts (gateway.enabled, role=gateway)
    episode_client.py  open_episode(gateway_url, task_id) -> Episode: base_url for `openai.OpenAI`, finish(reward)
    render.py          chat template with tools -> prompt ids; the next turn's ids without re-tokenising answers
    protocol.py        the OpenAI bodies: requests checked (ApiError: a 4xx with an OpenAI error body), answers built
    episodes.py        GatewayEpisode: an episode's group, its token chain (the last ChatTurn), the step held until
                       its reward is final; the registry
    spec.py            GatewaySpec: what the gateway takes of the run config
    agent_runner.py    what the example agents share: main(play, name, doc), --launch, --record, play_with (an SDK)
    shop_task.py       the example agents' task: the shop's tools (TOOLS, run_tool), TASKS, SYSTEM, check

See docs/gateway.md.
"""
