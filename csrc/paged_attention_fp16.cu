// Instantiates the decode kernels for __half. Kept apart from the torch glue
// (paged_attention.cu) so that the dtypes compile in parallel and without torch headers.
#include "paged_attention.cuh"

namespace asyncgen {

template bool launch_paged_attention_decode<__half>(const DecodeParams& p, cudaStream_t stream,
                                                             bool dependent);

}  // namespace asyncgen
