defmodule VllmBridge.CodecTest.Sample do
  @moduledoc false
  # Test-only struct for the Python dataclass vllm_bridge.bridge.diag.Sample.
  defstruct name: nil, level: :low, payload: nil
  def __python_class__, do: "vllm_bridge.bridge.diag.Sample"
  def __python_fields__, do: [:name, :level, :payload]
end

defmodule VllmBridge.Codec.WorkerRoundtripTest do
  @moduledoc """
  Values through a real Python worker and back (`vllm_bridge.bridge.diag.echo`): both codecs
  agree on tensors of every dtype, tuples, atoms, big integers, special floats and
  dataclasses.
  """
  use ExUnit.Case, async: true

  alias VllmBridge.{Bytes, Codec, Tensor, Worker}
  alias VllmBridge.CodecTest.Sample

  setup_all do
    :ok = Codec.Registry.register(Sample)
    {:ok, w} = Worker.start_link()
    {:ok, _hello} = Worker.await_ready(w)
    on_exit(fn -> close(w) end)
    %{w: w}
  end

  # The worker may already be gone (it stops once its Python process has exited).
  defp close(w) do
    Worker.close(w)
  catch
    :exit, _ -> :ok
  end

  defp echo(w, value), do: Worker.call(w, "vllm_bridge.bridge.diag", "echo", [value])

  test "tensors of every dtype, shape and special value", %{w: w} do
    for dtype <- Tensor.dtypes(), shape <- [[], [0, 3], [2, 3]] do
      n = Enum.reduce(shape, 1, &(&1 * &2)) * Tensor.itemsize(dtype)
      data = if dtype == :bool, do: :binary.copy(<<1>>, n), else: :rand.bytes(n)
      t = Tensor.new(data, dtype, shape)
      assert echo(w, t) == {:ok, t}, "#{dtype} #{inspect(shape)}"
    end

    for dtype <- [:float16, :bfloat16, :float32, :float64] do
      values = [1.0, -0.0, :nan, :infinity, :neg_infinity, 0.5, -2.25]
      {:ok, back} = echo(w, Tensor.from_list(values, dtype))
      assert Tensor.to_list(back) == values
    end

    # a tensor that arrives from a GPU comes back as the CPU tensor Python holds
    cuda = Tensor.from_list([1.5], :float32, device: "cuda:0")
    assert {:ok, %Tensor{device: "cpu"} = back} = echo(w, cuda)
    assert back.data == cuda.data

    # a tensor that Python moves to its own device comes back marked with that device
    device = Worker.hello(w)["device"]
    t = Tensor.from_list([[1, 2], [3, 4]], :int64)

    assert {:ok, %Tensor{device: ^device} = moved} =
             Worker.call(w, "vllm_bridge.bridge.diag", "to_device", [t])

    assert %{moved | device: "cpu"} == t

    big = Tensor.new(:rand.bytes(8 * 1024 * 1024), :float32, [2048, 1024])
    assert echo(w, big) == {:ok, big}
  end

  test "tuples, atoms and atom keys", %{w: w} do
    for value <- [
          {},
          {1, "a", {2.5, nil, [:ok]}},
          :ok,
          :error,
          [:a, :b],
          %{num_tokens: 8, uniform: true},
          %{"s" => {:x, %{y: {}}}}
        ] do
      assert echo(w, value) == {:ok, value}
    end
  end

  test "integers on both sides of the 64-bit range", %{w: w} do
    for i <- [
          0xFFFFFFFFFFFFFFFF,
          0x10000000000000000,
          -0x8000000000000000,
          -0x8000000000000001,
          Integer.pow(2, 100),
          -Integer.pow(3, 200)
        ] do
      assert echo(w, i) == {:ok, i}
    end
  end

  test "floats, NaN, infinities and the sign of zero", %{w: w} do
    for f <- [1.5, 5.0e-324, 1.7976931348623157e308, :nan, :infinity, :neg_infinity] do
      assert echo(w, f) == {:ok, f}
    end

    <<neg_zero::float-64>> = <<0x8000000000000000::64>>
    assert {:ok, z} = echo(w, neg_zero)
    assert <<z::float-64>> == <<0x8000000000000000::64>>
  end

  test "bytes, dataclasses and enum members", %{w: w} do
    assert echo(w, Bytes.new("abc")) == {:ok, "abc"}
    assert echo(w, <<0, 255>>) == {:ok, <<0, 255>>}

    sample = %Sample{name: "s", level: :high, payload: {1, [2]}}
    assert echo(w, sample) == {:ok, sample}
  end
end
