Code.require_file("../support/telemetry_helpers.exs", __DIR__)

defmodule VllmBridge.Runtime.ShmRouteTelemetryTest do
  @moduledoc """
  The route a call's gate resolves belongs to that call alone
  (VllmBridge.Call.Run.run_encoded/4). A large tensor encoded in the caller inside the
  call's scope after its arguments were encoded (a `:telemetry` handler of the call's
  own events that encodes one: the stand-in of test/support/telemetry_stand_in.exs) must
  resolve nothing that outlives the call: the caller's next call, without a large tensor,
  to another pool, runs on that pool (its answer names that pool's worker), and nothing
  of the route, the gate or the slots is left in the caller's process dictionary.

  Not async: the stand-in is loaded in `setup_all`, after the async tests ran without it.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.RuntimeHelpers
  import VllmBridge.TelemetryHelpers

  alias VllmBridge.{Codec, Shm, Tensor}

  # The stand-in :telemetry is loaded at run time (setup_all).
  @compile {:no_warn_undefined, :telemetry}

  @diag "vllm_bridge.bridge.diag"
  @a :rt_route_tel_a
  @b :rt_route_tel_b

  setup_all do
    load!()
    %{path: _} = Shm.dir()
    start_pool!(@a, size: 1, allow: [@diag])
    start_pool!(@b, size: 1, allow: [@diag])
    :ok
  end

  setup do
    for p <- [@a, @b], do: await_idle!(p)
    :ok
  end

  defp big(seed),
    do: Tensor.new(:binary.copy(<<seed + 0.0::little-float-32>>, 524_288), :float32, [524_288])

  defp os_pid(pool), do: hd(workers!(pool)).os_pid

  defp info(pool) do
    {:ok, %{"pid" => pid}} = VllmBridge.call({@diag, "info"}, [], %{}, pool_name: pool)
    pid
  end

  # Keys of the process dictionary that the scope and the run use (none may outlive a
  # call).
  defp call_keys do
    Enum.filter(Process.get_keys(), fn
      {VllmBridge.Call.Run, _} -> true
      {{VllmBridge.Call.Run, _}, _} -> true
      {VllmBridge.Shm, _} -> true
      _ -> false
    end)
  end

  # While attached, the handler encodes a large tensor in the calling process at each
  # `event` of a call to pool A (in the call's scope, after its arguments were encoded).
  defp encoding_handler(event) do
    me = self()
    id = {__MODULE__, make_ref()}

    :ok =
      :telemetry.attach(
        id,
        [:vllm_bridge, :call, event],
        fn _event, _measurements, meta, _config ->
          if self() == me and Map.get(meta, :pool) == @a do
            send(me, {:encoded, event, IO.iodata_length(Codec.encode(big(7)))})
          end
        end,
        nil
      )

    id
  end

  # Each way a call to A can meet a large tensor encoded after its arguments: at its
  # span's start or stop; with no large argument (its gate not asked yet), or with one
  # (asked already); then a plain call to B.
  for event <- [:start, :stop], large <- [false, true] do
    test "a large tensor encoded at a call's #{event} (large argument: #{large}) leaves " <>
           "no route for the next call" do
      a = os_pid(@a)
      b = os_pid(@b)
      assert a != b
      id = encoding_handler(unquote(event))

      args = if unquote(large), do: [big(1)], else: [1]

      try do
        assert {:ok, _} = VllmBridge.call({@diag, "echo"}, args, %{}, pool_name: @a)
        assert_received {:encoded, unquote(event), size}
        # The handler's tensor resolved nothing and went inline (2 MiB of data in the
        # frame), also when the call's own arguments had a slot: the scope is disarmed
        # once they are encoded, so the binary names no slot the call hands back.
        assert size > 2_097_152
      after
        :telemetry.detach(id)
      end

      assert call_keys() == []
      # Plain calls, no large tensor: each runs on the pool it names.
      assert info(@b) == b
      assert info(@a) == a
      assert info(@b) == b
      assert call_keys() == []
    end
  end
end
