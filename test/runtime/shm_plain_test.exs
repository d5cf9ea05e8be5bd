defmodule VllmBridge.Runtime.ShmPlainTest do
  @moduledoc """
  A call whose arguments are plain data skips the slot scope
  (`VllmBridge.Call.Run.run_encoded/4`, `VllmBridge.Shm.Writer.plain?/1`): only a struct
  (a tensor) can take a slot. `plain?/1` may call plain data "not plain" (a term past its
  budget: that call takes the scope, as before), never call a term that holds a struct
  plain. Generated terms, with structs planted anywhere (list, improper tail, tuple, map
  value, map key); then calls through a real worker, with the scope traced.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.{Shm, Tensor}
  alias VllmBridge.Call.{Run, Runtime, Wire}
  alias VllmBridge.Shm.Writer
  alias VllmBridge.TestSupport.TermGen

  @diag "vllm_bridge.bridge.diag"

  defp leaf, do: Enum.random([1, -7, 2.5, "s", :a, nil, true, <<0xFF, 1>>, [], %{}, {}])

  # A struct of a kind a payload may hold, or a map that only looks like one.
  defp planted do
    Enum.random([
      Tensor.new(<<1, 2, 3, 4>>, :int32, [1]),
      %URI{host: "x"},
      %{__struct__: :not_a_module}
    ])
  end

  defp term(depth, plant?) do
    leaf =
      if plant?,
        do: fn -> if :rand.uniform(6) == 1, do: planted(), else: leaf() end,
        else: &leaf/0

    TermGen.nested(depth,
      leaf: leaf,
      key: fn -> if plant? and :rand.uniform(8) == 1, do: planted(), else: leaf() end,
      extras: [fn sub -> [sub.() | sub.()] end, fn sub -> {[sub.()], %{"k" => sub.()}} end]
    )
  end

  # Whether `t` holds a struct anywhere (the reference: a full walk).
  defp struct_inside?(%{__struct__: _}), do: true

  defp struct_inside?(m) when is_map(m),
    do: Enum.any?(m, fn {k, v} -> struct_inside?(k) or struct_inside?(v) end)

  defp struct_inside?(t) when is_tuple(t), do: t |> Tuple.to_list() |> struct_inside?()
  defp struct_inside?([h | t]), do: struct_inside?(h) or struct_inside?(t)
  defp struct_inside?(_), do: false

  test "a term that holds a struct is never plain; small struct-free terms are" do
    :rand.seed(:exsss, {ExUnit.configuration()[:seed], 19, 7})

    counts =
      Enum.reduce(1..4_000, %{plain: 0, not_plain: 0, with_struct: 0}, fn i, acc ->
        t = {term(4, rem(i, 2) == 0), %{}}

        cond do
          struct_inside?(t) ->
            refute Writer.plain?(t), "called plain, with a struct inside: #{inspect(t)}"
            %{acc | with_struct: acc.with_struct + 1}

          Writer.plain?(t) ->
            %{acc | plain: acc.plain + 1}

          true ->
            %{acc | not_plain: acc.not_plain + 1}
        end
      end)

    # (The draw covered both answers for struct-free terms, and terms with structs.)
    assert counts.plain > 500 and counts.with_struct > 500, inspect(counts)

    for t <- [
          {[], %{}},
          {[1, "two", %{"three" => 3.0}], %{}},
          {[[1, 2 | 3], {:a, [nil]}], %{"k" => [true, false]}},
          {[%{[1] => {2, 3}}], %{"x" => <<0xFF>>}}
        ] do
      assert Writer.plain?(t), inspect(t)
    end

    # Past its budget (64 values looked at): not plain, however plain.
    refute Writer.plain?({Enum.to_list(1..100), %{}})
    refute Writer.plain?({[Map.new(1..100, &{&1, &1})], %{}})
    refute Writer.plain?({[List.to_tuple(Enum.to_list(1..100))], %{}})
    # A struct anywhere: the 60th element, a map key, an improper tail.
    tensor = Tensor.new(<<1, 2, 3, 4>>, :int32, [1])
    refute Writer.plain?({Enum.to_list(1..59) ++ [tensor], %{}})
    refute Writer.plain?({[%{tensor => 1}], %{}})
    refute Writer.plain?({[[1 | tensor]], %{}})
    refute Writer.plain?({[], %{"t" => tensor}})
  end

  describe "through a worker" do
    setup do
      %{path: _} = Shm.dir()
      start_pool!(:rt_plain, size: 1, allow: [@diag])
      on_exit(fn -> VllmBridge.stop_pool(:rt_plain) end)
      :erlang.trace_pattern({Writer, :scope, 2}, true, [:global])
      on_exit(fn -> :erlang.trace_pattern({Writer, :scope, 2}, false, [:global]) end)
      :ok
    end

    # diag.echo(arg) through run_encoded/4 in a fresh traced process: {result, how many
    # times it entered the scope, the keys its process dictionary was left with}.
    defp echo(arg) do
      me = self()
      {:ok, rt} = Runtime.resolve(pool_name: :rt_plain)

      # (Monitored: a caller that crashes fails the test with its reason, not a timeout.)
      {pid, mref} =
        spawn_monitor(fn ->
          receive do
            :go ->
              before = Keyword.keys(Process.get())

              result =
                Run.run_encoded(
                  rt,
                  "call",
                  fn -> Wire.encode_invoke({@diag, "echo"}, [arg], %{}) end,
                  what: {@diag, "echo"},
                  bound: nil,
                  payload: {[arg], %{}}
                )

              send(me, {:result, self(), result, Keyword.keys(Process.get()) -- before})
          end
        end)

      1 = :erlang.trace(pid, true, [:call])
      send(pid, :go)

      {result, left} =
        receive do
          {:result, ^pid, result, left} -> {result, left}
          {:DOWN, ^mref, :process, ^pid, reason} -> flunk("the caller died: #{inspect(reason)}")
        after
          # (Four calls a test, within ExUnit's 60 s.)
          12_000 ->
            Process.exit(pid, :kill)
            flunk("no answer to echo(#{inspect(arg, limit: 3)}) within 12 s")
        end

      Process.demonitor(mref, [:flush])
      ref = :erlang.trace_delivered(pid)
      assert_receive {:trace_delivered, ^pid, ^ref}, 10_000
      {result, count_scopes(pid, 0), left}
    end

    defp count_scopes(pid, n) do
      receive do
        {:trace, ^pid, :call, {Writer, :scope, _}} -> count_scopes(pid, n + 1)
      after
        0 -> n
      end
    end

    test "plain arguments skip the scope; a tensor, small or large, takes it" do
      await_idle!(:rt_plain)
      %{min_bytes: min} = Shm.dir()
      large = Tensor.new(:binary.copy(<<1, 0, 0, 0>>, div(min, 4) + 1), :int32, [div(min, 4) + 1])
      small = Tensor.new(<<1, 0, 0, 0>>, :int32, [1])

      for {arg, scopes} <- [
            {[1, "two", %{"three" => 3.0}], 0},
            {Enum.to_list(1..100), 1},
            {[small], 1},
            {%{"t" => large}, 1}
          ] do
        {result, entered, left} = echo(arg)
        assert result == {:ok, arg}, inspect(result, limit: 5)
        assert entered == scopes, "#{inspect(arg, limit: 3)}: entered the scope #{entered} times"
        # Nothing of the call is left in the calling process.
        assert left == [], inspect(left)
      end
    end
  end
end
