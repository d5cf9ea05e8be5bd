import Config

# Two pools of the same model, each worker building it with `tiny_lm.setup(seed)` before
# it takes a call (on_start), and again after a restart:
#
#   * :tiny     one worker, no data parallelism;
#   * :tiny_dp  two workers, DP ranks 0 and 1: TinyModel.Ranks.env/2 gives each its rank
#               and the rendezvous (a {module, function, args}: plain data, which every
#               config file can hold; config.exs cannot hold a function in a release).
#
# The Python module is found through python_path {:tiny_model, "priv/python"}, the app's
# own priv/python wherever the app lives (the build, or the release), and allow-listed
# with modules: (added to the library's default list).
seed = String.to_integer(System.get_env("TINY_MODEL_SEED", "7"))

# Rank 0 hosts the rendezvous on this port: TINY_MODEL_DP_PORT, else a free one now.
dp_port =
  case System.get_env("TINY_MODEL_DP_PORT") do
    nil ->
      {:ok, socket} = :gen_tcp.listen(0, ip: {127, 0, 0, 1})
      {:ok, port} = :inet.port(socket)
      :ok = :gen_tcp.close(socket)
      port

    port ->
      String.to_integer(port)
  end

own_code = [
  python_path: [{:tiny_model, "priv/python"}],
  modules: ["tiny_lm"],
  on_start: {"tiny_lm", "setup", [seed]}
]

config :vllm_bridge,
  pools: [
    tiny: [size: 1] ++ own_code,
    tiny_dp:
      [
        size: 2,
        worker_env: {TinyModel.Ranks, :env, [[size: 2, master_port: dp_port]]}
      ] ++ own_code
  ]

config :tiny_model, seed: seed
