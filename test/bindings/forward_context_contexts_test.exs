Code.require_file("../support/bindings_helpers.exs", __DIR__)

defmodule VllmBridge.Bindings.ForwardContextContextsTest do
  @moduledoc """
  `create_forward_context`, `set_forward_context` and `override_forward_context` of
  `Vllm.ForwardContext.Module` on real workers: every arity form (optional parameters
  positionally, by name, or both), the plain context-manager form (enter, returning the
  handle) and the `with_…` form (enter, run, always exit, on one worker), errors raised in
  the function, the ambiguous trailing argument, and bad arguments.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.BindingsHelpers

  alias Vllm.ForwardContext, as: Ctx
  alias Vllm.ForwardContext.BatchDescriptor
  alias Vllm.ForwardContext.Module, as: FC
  alias Vllm.Config.{CompilationConfig, VllmConfig}
  alias Vllm.Ubatch.UBatchSlice
  alias VllmBridge.{Error, Ref, Session, Tensor}

  setup_all do
    start_default_pool!(size: 2)
    :ok
  end

  @cfg %VllmConfig{compilation_config: %CompilationConfig{static_all_moe_layers: ["moe.0"]}}

  defp slot, do: %{"layer.0" => Tensor.from_list([0, 1], :int64)}
  defp slices, do: [%UBatchSlice{request_slice: {0, 1}, token_slice: {0, 4}}]

  # The optional parameters of set_forward_context, in order, with a non-default value
  # each, and the ForwardContext field that shows it was used.
  defp set_values do
    [
      virtual_engine: {1, &(&1.virtual_engine == 1)},
      num_tokens: {4, &(&1.batch_descriptor == nil or &1.batch_descriptor.num_tokens == 4)},
      num_tokens_across_dp: {nil, &(&1.dp_metadata == nil)},
      cudagraph_runtime_mode: {:piecewise, &(&1.cudagraph_runtime_mode == :piecewise)},
      batch_descriptor:
        {%BatchDescriptor{num_tokens: 4, uniform: true}, &(&1.batch_descriptor.uniform == true)},
      ubatch_slices: {slices(), &match?([%UBatchSlice{}], &1.ubatch_slices)},
      slot_mapping: {slot(), &(&1.slot_mapping == slot())},
      skip_compiled: {true, &(&1.skip_compiled == true)}
    ]
  end

  defp check_context(ctx, given) do
    for {name, {_value, holds}} <- given,
        do: assert(holds.(ctx), "#{name} not applied: #{inspect(ctx)}")

    # What was not given keeps Python's default.
    if not Keyword.has_key?(given, :virtual_engine), do: assert(ctx.virtual_engine == 0)

    if not Keyword.has_key?(given, :cudagraph_runtime_mode),
      do: assert(ctx.cudagraph_runtime_mode == :none)

    if not Keyword.has_key?(given, :skip_compiled), do: assert(ctx.skip_compiled == false)
  end

  test "create_forward_context: every arity, optional parameters positionally" do
    values = [
      virtual_engine: {2, &(&1.virtual_engine == 2)},
      dp_metadata: {nil, &(&1.dp_metadata == nil)},
      cudagraph_runtime_mode: {:full, &(&1.cudagraph_runtime_mode == :full)},
      batch_descriptor: {%BatchDescriptor{num_tokens: 8}, &(&1.batch_descriptor.num_tokens == 8)},
      ubatch_slices: {slices(), &match?([%UBatchSlice{}], &1.ubatch_slices)},
      slot_mapping: {slot(), &(&1.slot_mapping == slot())},
      additional_kwargs: {%{"k" => 1}, &(&1.additional_kwargs == %{"k" => 1})},
      skip_compiled: {true, &(&1.skip_compiled == true)}
    ]

    for k <- 0..length(values), with_opts <- [false, true] do
      given = Enum.take(values, k)
      args = [%{"attn" => 1}, @cfg | Enum.map(given, fn {_, {v, _}} -> v end)]
      args = if with_opts, do: args ++ [[__runtime__: [timeout: 30_000]]], else: args

      assert {:ok, %Ctx{} = ctx} = apply(FC, :create_forward_context, args),
             "arity #{length(args)}"

      check_context(ctx, given)
      assert ctx.attn_metadata == %{"attn" => 1}
      assert ctx.all_moe_layers == ["moe.0"]
    end
  end

  test "create_forward_context: by name, mixed, and the ambiguous last argument" do
    bd = %BatchDescriptor{num_tokens: 8}

    assert {:ok, %Ctx{batch_descriptor: ^bd, virtual_engine: 0}} =
             FC.create_forward_context(nil, @cfg, batch_descriptor: bd)

    assert {:ok, %Ctx{virtual_engine: 1, skip_compiled: true}} =
             FC.create_forward_context(nil, @cfg, 1, skip_compiled: true)

    # A keyword list in an optional place is the options, whatever the parameter there.
    assert {:ok, %Ctx{virtual_engine: 3}} =
             FC.create_forward_context(nil, @cfg, virtual_engine: 3)

    assert {:ok, %Ctx{ubatch_slices: nil}} =
             FC.create_forward_context(nil, @cfg, 0, nil, :none, nil, [])

    # [] as the value of ubatch_slices: put the options after it.
    assert {:ok, %Ctx{ubatch_slices: []}} =
             FC.create_forward_context(nil, @cfg, 0, nil, :none, nil, [], [])

    assert {:error, %Error{type: :bad_argument, message: m}} =
             FC.create_forward_context(nil, @cfg, 0, nil, :none, nil, uniform: true)

    assert m =~ "create_forward_context/7: unknown option :uniform"

    assert {:error, %Error{type: :bad_argument, message: m}} =
             FC.create_forward_context(nil, @cfg, 1, virtual_engine: 2)

    assert m =~ "virtual_engine given both positionally and as an option"
  end

  test "create_forward_context: bad arguments are refused, naming them" do
    for {args, pattern} <- [
          {[nil, "config"], ~s|vllm_config must be Vllm.Config.VllmConfig.t(), got "config"|},
          {[nil, @cfg, "0"], ~s|virtual_engine must be integer(), got "0"|},
          {[nil, @cfg, 0, nil, :bogus],
           "cudagraph_runtime_mode must be Vllm.Cudagraph.CUDAGraphMode.t(), got :bogus"},
          {[nil, @cfg, [virtual_engine: :x]], "virtual_engine must be integer(), got :x"},
          {[nil, @cfg, 0, nil, :none, nil, nil, nil, nil, false, :opts],
           "must be a keyword list of options, got :opts"}
        ] do
      assert {:error, %Error{type: :bad_argument, message: m}} =
               apply(FC, :create_forward_context, args)

      assert m =~ pattern
    end

    # Values of the right type that Python refuses: a Python exception naming them.
    assert {:error, %Error{type: :python_exception, python_type: "ValueError", message: m}} =
             FC.create_forward_context(nil, @cfg, -1)

    assert m =~ "virtual_engine must be >= 0, got -1"

    assert {:error, %Error{type: :python_exception, message: m}} =
             FC.create_forward_context(nil, @cfg, cudagraph_runtime_mode: :full_and_piecewise)

    assert m =~ "Invalid cudagraph runtime mode: FULL_AND_PIECEWISE"

    assert {:error, %Error{type: :bad_argument, message: m}} =
             FC.create_forward_context(nil, @cfg,
               batch_descriptor: %BatchDescriptor{num_tokens: -1}
             )

    assert m =~ "num_tokens"
  end

  test "set_forward_context: every arity enters in the session; exit restores" do
    s = session!()
    rt = [__runtime__: [session_id: s]]
    values = set_values()

    for k <- 0..length(values) do
      given = Enum.take(values, k)
      args = [%{"attn" => 1}, @cfg | Enum.map(given, fn {_, {v, _}} -> v end)] ++ [rt]
      assert {:ok, {%Ref{type: "context"} = handle, nil}} = apply(FC, :set_forward_context, args)
      assert {:ok, ctx} = FC.get_forward_context(rt)
      check_context(ctx, given)
      assert {:ok, false} = VllmBridge.exit(handle, nil, session_id: s)
      assert FC.is_forward_context_available(rt) == {:ok, false}
    end
  end

  test "set_forward_context without options: arities 2..10, in the current session" do
    values = set_values()

    # No session at all: refused (a context must belong to one), nothing entered.
    assert {:error, %Error{type: :bad_argument, message: m}} = FC.set_forward_context(nil, @cfg)
    assert m =~ "needs a session"
    assert FC.is_forward_context_available() == {:ok, false}

    VllmBridge.with_session(fn s ->
      for k <- 0..length(values) do
        args = [nil, @cfg | Enum.map(Enum.take(values, k), fn {_, {v, _}} -> v end)]

        assert {:ok, {%VllmBridge.Ref{session: sid} = handle, nil}} =
                 apply(FC, :set_forward_context, args)

        assert sid == s.id
        assert FC.is_forward_context_available() == {:ok, true}
        assert {:ok, false} = VllmBridge.exit(handle)
        assert FC.is_forward_context_available() == {:ok, false}
      end
    end)
  end

  test "inside a with_ form, calls that name no session see the context" do
    assert {:ok, {:ok, %Ctx{virtual_engine: 3}}} =
             FC.with_set_forward_context(nil, @cfg, 3, fn nil -> FC.get_forward_context() end)

    assert {:error, %Error{type: :python_exception}} = FC.get_forward_context()
  end

  test "with_set_forward_context: every arity, in a temporary session, always exits" do
    values = set_values()

    for k <- 0..length(values), opts <- [nil, []] do
      given = Enum.take(values, k)
      args = [nil, @cfg | Enum.map(given, fn {_, {v, _}} -> v end)]
      args = if opts, do: args ++ [opts], else: args

      fun = fn nil, %Session{} = s ->
        assert {:ok, ctx} = FC.get_forward_context(__runtime__: [session_id: s])
        check_context(ctx, given)
        {:seen, s}
      end

      assert {:ok, {:seen, s}} = apply(FC, :with_set_forward_context, args ++ [fun])
      # The temporary session is closed: its context is gone with it.
      assert {:error, %Error{type: :bad_argument, message: m}} =
               FC.is_forward_context_available(__runtime__: [session_id: s.id])

      assert m =~ "unknown session_id"
    end
  end

  test "with_set_forward_context in the caller's session; a one-argument function" do
    s = session!()
    rt = [__runtime__: [session_id: s.id]]

    assert {:ok, :inside} =
             FC.with_set_forward_context(nil, @cfg, 5, rt, fn nil ->
               assert {:ok, %Ctx{virtual_engine: 5}} = FC.get_forward_context(rt)
               :inside
             end)

    assert FC.is_forward_context_available(rt) == {:ok, false}

    # Nested: the outer context comes back when the inner one exits.
    assert {:ok, {:ok, %Ctx{virtual_engine: 1}}} =
             FC.with_set_forward_context(nil, @cfg, 1, rt, fn nil, ^s ->
               {:ok, _} =
                 FC.with_set_forward_context(nil, @cfg, 2, rt, fn _ ->
                   FC.get_forward_context(rt)
                 end)

               FC.get_forward_context(rt)
             end)
  end

  test "an error raised in the function reaches __exit__ and is re-raised" do
    s = session!()
    rt = [__runtime__: [session_id: s]]

    assert_raise RuntimeError, "boom", fn ->
      FC.with_set_forward_context(nil, @cfg, rt, fn nil ->
        assert FC.is_forward_context_available(rt) == {:ok, true}
        raise "boom"
      end)
    end

    assert FC.is_forward_context_available(rt) == {:ok, false}

    # A throw is passed on too.
    assert catch_throw(FC.with_set_forward_context(nil, @cfg, rt, fn _ -> throw(:out) end)) ==
             :out

    assert FC.is_forward_context_available(rt) == {:ok, false}

    # The error of a Python call in the body, raised: __exit__ gets the real exception
    # (and re-raises it, so it is not suppressed).
    error =
      assert_raise Error, fn ->
        FC.with_set_forward_context(nil, @cfg, rt, fn _ ->
          {:error, e} = FC._compute_sp_num_tokens(Tensor.from_list([1], :int64), 0, rt)
          raise e
        end)
      end

    assert error.python_type == "ValueError" and error.message =~ "sequence_parallel_size"
    assert FC.is_forward_context_available(rt) == {:ok, false}
  end

  test "with_ forms refuse a bad function or bad arguments before entering" do
    s = session!()
    rt = [__runtime__: [session_id: s]]

    assert {:error, %Error{type: :bad_argument, message: m}} =
             FC.with_set_forward_context(nil, @cfg, rt, :not_a_fun)

    assert m =~
             "with_set_forward_context/4: the last argument must be a function of 1 or 2 arguments"

    assert {:error, %Error{type: :bad_argument}} =
             FC.with_set_forward_context(nil, "cfg", fn _ -> flunk("ran") end)

    assert {:error, %Error{type: :python_exception, message: m}} =
             FC.with_set_forward_context(nil, @cfg, 0, nil, nil, :full_decode_only, rt, fn _ ->
               flunk("ran")
             end)

    assert m =~ "FULL_DECODE_ONLY"
    assert FC.is_forward_context_available(rt) == {:ok, false}
  end

  test "override_forward_context: both forms, nil clears, the previous comes back" do
    s = session!()
    rt = [__runtime__: [session_id: s]]
    {:ok, outer} = FC.create_forward_context(nil, @cfg, 1)
    {:ok, inner} = FC.create_forward_context(nil, @cfg, 2)

    assert {:ok, {handle, nil}} = FC.override_forward_context(outer, rt)
    assert {:ok, %Ctx{virtual_engine: 1}} = FC.get_forward_context(rt)

    assert {:ok, :done} =
             FC.with_override_forward_context(inner, rt, fn nil, ^s ->
               assert {:ok, %Ctx{virtual_engine: 2}} = FC.get_forward_context(rt)

               {:ok, _} =
                 FC.with_override_forward_context(nil, rt, fn _ ->
                   assert FC.is_forward_context_available(rt) == {:ok, false}
                 end)

               :done
             end)

    assert {:ok, %Ctx{virtual_engine: 1}} = FC._forward_context(rt)
    assert {:ok, false} = VllmBridge.exit(handle, nil, session_id: s)
    assert FC._forward_context(rt) == {:ok, nil}

    assert {:error, %Error{type: :bad_argument}} = FC.override_forward_context(outer)

    VllmBridge.with_session(fn _ ->
      assert {:ok, {h, nil}} = FC.override_forward_context(outer)
      assert {:ok, %Ctx{virtual_engine: 1}} = FC.get_forward_context()
      assert {:ok, false} = VllmBridge.exit(h)
    end)

    assert {:ok, 2} =
             FC.with_override_forward_context(inner, fn _ ->
               {:ok, ctx} = FC.get_forward_context()
               ctx.virtual_engine
             end)

    assert {:error, %Error{type: :bad_argument, message: m}} =
             FC.override_forward_context(%{virtual_engine: 1})

    assert m =~ "forward_context must be Vllm.ForwardContext.t() | nil"
  end
end
