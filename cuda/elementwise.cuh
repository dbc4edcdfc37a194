// Conversions shared by glmcheck's elementwise kernels (cuda/rope.cu, cuda/fused.cu): `up` reads a
// value of the dtype as f32 (exact), `down` rounds an f32 to the dtype (round to nearest even, as
// candle's casts and torch's eager ops do), `rn` is one operation's f32 result rounded to the dtype
// and read back (for f32 the identity: the _rn intrinsics already rounded it).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace glmcheck {

template <typename T> __device__ __forceinline__ float up(T v);
template <> __device__ __forceinline__ float up<float>(float v) { return v; }
template <> __device__ __forceinline__ float up<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float up<half>(half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T down(float v);
template <> __device__ __forceinline__ float down<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 down<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ half down<half>(float v) { return __float2half_rn(v); }

template <typename T> __device__ __forceinline__ float rn(float v) { return up<T>(down<T>(v)); }

} // namespace glmcheck
