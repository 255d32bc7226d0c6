// Instantiates the decode kernels for __nv_bfloat16. Kept apart from the torch glue
// (paged_attention.cu) so that the dtypes compile in parallel and without torch headers.
#include "paged_attention.cuh"

namespace asyncgen {

template bool launch_paged_attention_decode<__nv_bfloat16>(const DecodeParams& p, cudaStream_t stream,
                                                             bool dependent);

}  // namespace asyncgen
