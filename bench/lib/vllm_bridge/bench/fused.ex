defmodule VllmBridge.Bench.Fused do
  @moduledoc """
  The whole stack's steps for the trivial call, written as one function: the bound of
  what flattening the Elixir path's layers (binding, options, routing, request) could
  gain without dropping a step (issue 19; bench/results/caller-path.md).

  It does what the lean path does for the call, in the same order and with the same
  data: reads the runtime config, the process's session and the clock, the pool's meta,
  checks that nobody is queued, reserves a slot, reads the worker's pid, builds the frame
  from the binding's cached target encoding, makes the alias, sends the same submit
  message (VllmBridge.Worker.Messages) to the same worker process, and decodes the
  reply. It leaves out only the
  layers between them: the binding's argument split, the options' struct, the request
  struct, the frame-limit check (the frame is known to fit), telemetry's check and the
  result's look for references.
  """

  require VllmBridge.Worker.Messages

  alias VllmBridge.Call.Wire
  alias VllmBridge.Pool.{Directory, Slots}
  alias VllmBridge.Worker.Messages
  alias VllmBridge.Worker.Messages.Submit

  @target {"vllm_bridge.forward_context", "is_forward_context_available"}
  @timeout_ms 120_000

  @doc """
  One trivial call on pool `pool` (whose binding has run once, so that its target's
  encoding is cached): `{:ok, boolean}`.
  """
  @spec call(term()) :: {:ok, boolean()} | {:error, term()}
  def call(pool) do
    {module, path} = @target
    now = :erlang.monotonic_time(:millisecond)
    _config = :application.get_env(:vllm_bridge, :runtime)
    nil = VllmBridge.Session.current()
    deadline = now + @timeout_ms
    {:ok, meta} = Directory.pool(pool)
    0 = Slots.waiting(meta)
    i = Slots.reserve_any(meta)
    pid = Directory.worker_pid(pool, i)
    encoded = VllmBridge.Call.Wire.Args.binding_target(module, path)
    id = :erlang.unique_integer([:positive])
    mref = :erlang.monitor(:process, pid, [{:alias, :reply_demonitor}])
    ms = Wire.uint(@timeout_ms)
    fields = [<<0xC0>>, ms, encoded, 0x90, <<0x80>>]
    size = byte_size(ms) + byte_size(encoded) + 3
    {:ok, frame, size} = Wire.frame_request("call", id, fields, size)

    Messages.send_submit(pid, %Submit{
      id: id,
      alias: mref,
      caller: self(),
      frame: frame,
      size: size,
      deadline: deadline,
      holds_slot: true,
      what: {"call", @target}
    })

    receive do
      Messages.reply(^mref, bin, origin) -> Wire.decode_reply(bin, origin, pid)
      Messages.worker_exit(^mref, message) -> {:error, message}
      Messages.reply_error(^mref, e) -> {:error, e}
      {:DOWN, ^mref, _, _, reason} -> {:error, reason}
    after
      @timeout_ms -> {:error, :timeout}
    end
  end
end
