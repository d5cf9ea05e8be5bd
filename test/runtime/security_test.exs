defmodule VllmBridge.Runtime.SecurityTest do
  @moduledoc """
  The allow-list holds through `VllmBridge.call/get/stream/enter` (docs/SECURITY.md): the
  issue's escape through a generator's frame, a module outside the allow-list handed back
  or passed as an argument, capabilities a user module holds; each is refused with
  `:bad_argument` naming the step, and ordinary use (a torch module by reference, its
  methods and attributes, streams and context managers) still works.
  """
  use ExUnit.Case, async: false

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.{Error, Ref, Tensor}

  @moduletag :capture_log
  @pool :rt_security
  @probe "rt_security_probe"
  @diag "vllm_bridge.bridge.diag"

  setup_all do
    start_pool!(@pool,
      size: 1,
      allow: [@diag, @probe],
      # test/support first, whatever the environment's PYTHONPATH already holds after.
      worker_env: [
        {"PYTHONPATH", Enum.join([support_dir() | List.wrap(System.get_env("PYTHONPATH"))], ":")}
      ]
    )

    :ok
  end

  defp opts(extra \\ []), do: [pool_name: @pool] ++ extra
  defp call(target, args \\ [], extra \\ []), do: VllmBridge.call(target, args, %{}, opts(extra))

  defp refused!(result, fragment) do
    assert {:error, %Error{type: :bad_argument, message: message}} = result
    assert message =~ fragment
    assert message =~ "docs/SECURITY.md"
    # The worker serves on.
    assert {:ok, 3} = call({@diag, "add"}, [1, 2])
    message
  end

  # A dataclass decodes to its struct when a module of this run defines one for the class
  # (the codec tests do), else to %VllmBridge.Object{}: the fields either way.
  defp fields(%VllmBridge.Object{fields: fields}), do: fields

  defp fields(%_{} = struct),
    do: struct |> Map.from_struct() |> Map.new(fn {k, v} -> {Atom.to_string(k), v} end)

  describe "escapes" do
    test "the issue's example: a generator's frame, its builtins, eval" do
      {:ok, %Ref{} = g} = call({@diag, "count"}, [3])

      message =
        refused!(
          call({g, "gi_frame.f_builtins.get"}, ["eval"]),
          "(builtins.generator).gi_frame is a builtins.frame object"
        )

      assert message =~ "interpreter introspection"
      # The generator itself is still usable: it streams.
      {:ok, s} = VllmBridge.stream({g, nil}, [], %{}, opts())
      assert Enum.to_list(s) == [0, 1, 2]
    end

    test "get of a generator's code" do
      {:ok, g} = call({@diag, "count"}, [1])
      refused!(VllmBridge.get({g, "gi_code"}, opts()), ".gi_code is a builtins.code object")
    end

    test "a module outside the allow-list never becomes a reference, so it cannot be passed" do
      refused!(call({@probe, "module"}, ["os"]), "the reply to call")
      refused!(call({@probe, "module"}, ["sys"]), "the module 'sys'")
      refused!(VllmBridge.get({@probe, "os"}, opts()), "rt_security_probe.os is the module 'os'")
    end

    test "a module reference passed as an argument is checked where it is used" do
      # The probe itself is allow-listed, so a reference to it may exist; once the module
      # is imported afresh, the old object is no longer the allow-listed module.
      {:ok, %Ref{} = m} = call({@probe, "itself"})
      assert {:ok, %Ref{}} = call({@probe, "identity"}, [m])
      assert {:ok, true} = call({@probe, "reimport"})

      refused!(
        call({@probe, "identity"}, [m]),
        "argument reference #{m.id} (builtins.module) is the module 'rt_security_probe'"
      )

      refused!(call({@diag, "echo"}, [%{"nested" => [m]}]), "a module outside the allow-list")
      refused!(call({m, "identity"}, [1]), "reference #{m.id} (builtins.module)")
    end

    test "capabilities a user module holds" do
      refused!(call({@probe, "SYSTEM"}, ["true"]), "the builtin posix.system")
      refused!(call({@probe, "BUILTINS_COPY.get"}, ["eval"]), "the builtin builtins.eval")

      refused!(
        VllmBridge.get({@diag, "sys"}, opts()),
        "vllm_bridge.bridge.diag.sys is the module 'sys'"
      )
    end

    test "an open file is refused as a stream and as a context manager" do
      refused!(
        VllmBridge.with_context({@probe, "opened"}, [], %{}, opts(), fn _ -> :entered end),
        "the result of rt_security_probe.opened is a _io.TextIOWrapper object"
      )

      assert {:ok, s} = VllmBridge.stream({@probe, "opened"}, [], %{}, opts())
      error = catch_error(Enum.to_list(s))
      assert %Error{type: :bad_argument, message: message} = error
      assert message =~ "the result of rt_security_probe.opened"
    end
  end

  describe "ordinary use" do
    test "a torch module by reference: its methods, attributes and parameters" do
      {:ok, %Ref{type: "torch.nn.modules.container.Sequential"} = model} =
        call({@probe, "make_model"})

      x = Tensor.from_list([[1.0, 2.0, 3.0]], :float32)
      assert {:ok, %Tensor{shape: [1, 2]}} = call({model, "forward"}, [x])
      assert {:ok, %Tensor{shape: [2, 3]}} = VllmBridge.get({model, "0.weight"}, opts())
      assert {:ok, %Ref{} = params} = call({model, "parameters"})
      {:ok, s} = VllmBridge.stream({params, nil}, [], %{}, opts())
      assert Enum.map(s, & &1.shape) == [[2, 3], [2]]
      assert {:ok, %Ref{}} = call({model, "train"}, [false])
      assert {:ok, false} = VllmBridge.get({model, "training"}, opts())
    end

    test "a context manager and a dataclass" do
      assert {:ok, {:entered, "r"}} =
               VllmBridge.with_context({@diag, "recorder"}, ["r"], %{}, opts(), fn name ->
                 {:entered, name}
               end)

      assert {:ok, sample} = call({@diag, "Sample"}, ["s", :high])
      assert fields(sample) == %{"name" => "s", "level" => :high, "payload" => nil}
    end
  end
end
