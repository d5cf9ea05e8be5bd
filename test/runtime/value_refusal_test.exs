defmodule VllmBridge.Runtime.ValueRefusalTest do
  @moduledoc """
  Values Python cannot take never wedge a caller (issue: `echo(%{[1] => 2})` waited out
  its whole deadline, and the worker was killed with every session on it):

    * through the API they are refused before anything is sent, naming the argument;
    * sent anyway (an unchecked encoder standing for a careless or hostile peer), the
      worker answers at once under the request's id with `:bad_argument` naming what and
      where, also under `timeout_profile: :batch_job`, and the worker, its OS process and
      its sessions stay.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.{Error, Session}
  alias VllmBridge.Call.{Request, Runtime, Wire}
  alias VllmBridge.Codec.Msgpack
  alias VllmBridge.TestSupport.Unchecked

  @pool :rt_refusal

  setup_all do
    start_pool!(@pool, size: 1)
    :ok
  end

  setup do
    [w] = workers!(@pool)
    %{w: w}
  end

  defp echo(value, opts \\ []),
    do:
      VllmBridge.call(
        {"vllm_bridge.bridge.diag", "echo"},
        [value],
        %{},
        [pool_name: @pool] ++ opts
      )

  # A call of diag.echo whose argument is encoded without the checks, sent to the pool's
  # only worker like any other request.
  defp raw_echo(value, opts) do
    {:ok, rt} = Runtime.resolve([pool_name: @pool] ++ opts)
    [w] = workers!(@pool)
    args = [0x91 | Msgpack.encode(value, Unchecked, 2000)]
    parts = [Wire.value(["m", "vllm_bridge.bridge.diag", "echo"]), args, Wire.value(%{})]
    req = Request.new("call", pre: [Wire.value(rt.session_id)], post: parts)
    Request.call(w.pid, req, rt.deadline)
  end

  defp nest(n, leaf), do: Enum.reduce(1..n, leaf, fn _, acc -> [acc] end)

  @refused [
    {%{[1] => 2}, "the map key [1] is a list"},
    {%{%{} => 1}, "the map key %{} is a map"},
    {%{{1, [2]} => 1}, "holds a list"},
    {%{1 => "a", true => "b"}, "the map keys 1 and true are equal in Python"},
    {%{1 => :x, 1.0 => :y}, "the map keys 1 and 1.0 are equal in Python"},
    {%{:a => 1, "a" => 2}, ~s(the map keys :a and "a" are equal in Python)}
  ]

  test "the API refuses them before sending, naming the argument" do
    for {value, why} <- @refused do
      assert {:error, %Error{type: :bad_argument, message: message}} = echo(value, timeout: 2_000)

      assert "args[0]: " <> _ = message
      assert message =~ why
    end

    assert {:error,
            %Error{type: :bad_argument, message: "args[0]: cannot encode a value nested" <> _}} =
             echo(nest(1100, 1))

    assert {:ok, _} = echo(nest(64, 1))
  end

  test "sent anyway, each is answered at once by the worker under its id, naming where", %{w: w} do
    {:ok, s} = Session.open(pool_name: @pool)
    on_exit(fn -> Session.close(s) end)

    assert {:ok, nil} =
             VllmBridge.call({"vllm_bridge.bridge.diag", "set_var"}, ["kept"], %{},
               session_id: s.id
             )

    deep = [nest(1100, 1), Enum.reduce(1..1100, 1, fn _, acc -> %{"k" => acc} end)]

    for {value, why} <- Enum.map(deep, &{&1, "nests deeper than msgpack's limit"}) ++ @refused,
        profile <- [:default, :batch_job] do
      assert {:error, %Error{type: :bad_argument, message: message}} =
               raw_echo(value, session_id: s.id, timeout_profile: profile)

      assert message =~ "could not decode args[0]"
      assert message =~ why
    end

    # The same OS process, the session's state intact, nothing left in flight.
    assert {:ok, %{"pid" => pid}} =
             VllmBridge.call({"vllm_bridge.bridge.diag", "info"}, [], %{}, pool_name: @pool)

    assert pid == w.os_pid

    assert {:ok, "kept"} =
             VllmBridge.call({"vllm_bridge.bridge.diag", "get_var"}, [], %{}, session_id: s.id)

    assert VllmBridge.Worker.in_flight(w.pid) == 0
  end

  test "a refused value inside a larger argument is located", %{w: _w} do
    value = [1, %{"outer" => {2, %{"inner" => %{1 => :a, true => :b}}}}]

    assert {:error, %Error{type: :bad_argument, message: message}} =
             raw_echo(value, timeout: 5_000)

    assert message =~
             ~s(could not decode args[0][1]["outer"][1]["inner"]: the map keys 1 and true)
  end
end
