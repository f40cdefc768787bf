/* ONNX Runtime custom ops in the ai.edgelm domain on GGUF blocks as the file stores them (blocks.h):
 *
 *   MatMulPacked(A float32 [..., K], B uint8 [N, row_bytes]) -> Y float32 [..., N],  Y = A · Wᵀ
 *   GatherPacked(data uint8 [V, row_bytes], indices int64 or int32 [...]) -> output float32 [..., K]
 *
 * attributes packed_type (the ggml type number), N and K (MatMulPacked), K (GatherPacked): the contract of ONNX
 * Runtime's com.microsoft.MatMulPacked / GatherPacked (which take fp16/bf16 activations; these float32), so a
 * package can move to those ops the day ONNX Runtime has CPU kernels for them. Threads come from ONNX Runtime's
 * intra-op pool (KernelContext_ParallelFor); every bad shape or attribute is an error status, never a crash.
 * Built against any onnxruntime_c_api.h from 1.17 on; asks for API version 17. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"
#include "onnxruntime_c_api.h"

#define EB_ORT_API 17 /* KernelContext_ParallelFor's version: the newest function used */
#define ROWS_A_TASK 32 /* weight rows one task of the pool computes: 32 x row_bytes, well within L2 */
#define STACK_WORKSPACE 32768 /* bytes: quantized activations up to this size live on the stack */

static const OrtApi *ort;

static OrtStatus *fail(const char *op, const char *message) {
    char text[512];
    snprintf(text, sizeof text, "ai.edgelm.%s: %s", op, message);
    return ort->CreateStatus(ORT_INVALID_ARGUMENT, text);
}

#define CHECK(call)                          \
    do {                                     \
        OrtStatus *status_ = (call);         \
        if (status_ != NULL) return status_; \
    } while (0)

typedef struct {
    int type, elems, bytes;
    int64_t n, k, row_bytes;
    int isa;
} Packed;

/* Whether the node has the int64 attribute `name` (read into *value); ONNX Runtime's status for an absent one is
   released here, not leaked. */
static int attribute(const OrtKernelInfo *info, const char *name, int64_t *value) {
    OrtStatus *status = ort->KernelInfoGetAttribute_int64(info, name, value);
    if (status == NULL) return 1;
    ort->ReleaseStatus(status);
    return 0;
}

static OrtStatus *read_packed(const char *op, const OrtKernelInfo *info, int with_n, Packed *p) {
    int64_t type = -1, k = 0, n = 0;
    if (!attribute(info, "packed_type", &type)) return fail(op, "no packed_type attribute");
    if (!attribute(info, "K", &k)) return fail(op, "no K attribute");
    if (with_n && !attribute(info, "N", &n)) return fail(op, "no N attribute");
    char text[200];
    if (type < 0 || type > INT_MAX || eb_block_shape((int)type, &p->elems, &p->bytes) != 0) {
        snprintf(text, sizeof text, "packed_type %lld is not a block type these kernels read", (long long)type);
        return fail(op, text);
    }
    if (k <= 0 || k % p->elems != 0 || (with_n && n <= 0)) {
        snprintf(text, sizeof text, "K=%lld must be a positive multiple of %d and N=%lld positive", (long long)k,
                 p->elems, (long long)n);
        return fail(op, text);
    }
    p->type = (int)type;
    p->k = k;
    p->n = n;
    p->row_bytes = k / p->elems * p->bytes;
    p->isa = eb_best_isa();
    return NULL;
}

typedef struct {
    const int64_t *dims;
    size_t rank;
    ONNXTensorElementDataType type;
    const void *data;
} Tensor;

static OrtStatus *input(OrtKernelContext *context, size_t index, Tensor *t, int64_t *dims, size_t max_rank) {
    const OrtValue *value = NULL;
    OrtTensorTypeAndShapeInfo *shape = NULL;
    CHECK(ort->KernelContext_GetInput(context, index, &value));
    CHECK(ort->GetTensorTypeAndShape(value, &shape));
    OrtStatus *status = ort->GetDimensionsCount(shape, &t->rank);
    if (status == NULL && t->rank > max_rank) status = ort->CreateStatus(ORT_INVALID_ARGUMENT, "ai.edgelm: rank over 8");
    if (status == NULL) status = ort->GetDimensions(shape, dims, t->rank);
    if (status == NULL) status = ort->GetTensorElementType(shape, &t->type);
    ort->ReleaseTensorTypeAndShapeInfo(shape);
    CHECK(status);
    t->dims = dims;
    return ort->GetTensorData(value, &t->data);
}

/* --- MatMulPacked --- */

typedef struct {
    const Packed *p;
    const float *a;
    const uint8_t *b;
    float *y;
    void *work;
    int64_t m;
} MatMulTask;

static void quantize_task(void *data, size_t index) {
    MatMulTask *t = data;
    eb_quantize_rows(t->p->type, t->a, t->m, t->p->k, t->work, (int64_t)index, (int64_t)index + 1);
}

static void matmul_task(void *data, size_t index) {
    MatMulTask *t = data;
    int64_t start = (int64_t)index * ROWS_A_TASK, stop = start + ROWS_A_TASK < t->p->n ? start + ROWS_A_TASK : t->p->n;
    eb_matmul_rows(t->p->type, t->p->isa, t->work, t->m, t->p->k, t->b, start, stop, t->y, t->p->n);
}

static OrtStatus *matmul_compute(void *kernel, OrtKernelContext *context) {
    const Packed *p = kernel;
    int64_t a_dims[8], b_dims[8], y_dims[8];
    Tensor a, b;
    CHECK(input(context, 0, &a, a_dims, 8));
    CHECK(input(context, 1, &b, b_dims, 8));
    char text[300];
    if (a.rank < 1 || a.dims[a.rank - 1] != p->k) {
        snprintf(text, sizeof text, "A's last axis must be K=%lld", (long long)p->k);
        return fail("MatMulPacked", text);
    }
    if (b.rank != 2 || b.dims[0] != p->n || b.dims[1] != p->row_bytes) {
        snprintf(text, sizeof text, "B must be [N=%lld, %lld] (K=%lld of packed_type %d), got rank %zu [%lld, %lld]",
                 (long long)p->n, (long long)p->row_bytes, (long long)p->k, p->type, b.rank,
                 (long long)(b.rank > 0 ? b.dims[0] : -1), (long long)(b.rank > 1 ? b.dims[1] : -1));
        return fail("MatMulPacked", text);
    }
    int64_t m = 1;
    for (size_t i = 0; i + 1 < a.rank; i++) {
        m *= a.dims[i];
        y_dims[i] = a.dims[i];
    }
    y_dims[a.rank - 1] = p->n;
    OrtValue *out = NULL;
    CHECK(ort->KernelContext_GetOutput(context, 0, y_dims, a.rank, &out));
    float *y = NULL;
    CHECK(ort->GetTensorMutableData(out, (void **)&y));
    if (m == 0) return NULL;
    /* a decode step's activations fit on the stack: no allocation a call */
    _Alignas(64) uint8_t small[STACK_WORKSPACE];
    const size_t bytes = eb_workspace_bytes(p->type, m, p->k);
    MatMulTask task = {p, a.data, b.data, y, bytes <= sizeof small ? small : malloc(bytes), m};
    if (task.work == NULL) return ort->CreateStatus(ORT_FAIL, "ai.edgelm.MatMulPacked: out of memory");
    OrtStatus *status = NULL;
    if (m > 1)
        status = ort->KernelContext_ParallelFor(context, quantize_task, (size_t)m, 0, &task);
    else
        eb_quantize_rows(p->type, task.a, m, p->k, task.work, 0, m);
    if (status == NULL)
        status = ort->KernelContext_ParallelFor(context, matmul_task, (size_t)((p->n + ROWS_A_TASK - 1) / ROWS_A_TASK),
                                                0, &task);
    if (task.work != small) free(task.work);
    return status;
}

/* --- GatherPacked --- */

static OrtStatus *gather_compute(void *kernel, OrtKernelContext *context) {
    const Packed *p = kernel;
    int64_t d_dims[8], i_dims[8], o_dims[9];
    Tensor data, indices;
    CHECK(input(context, 0, &data, d_dims, 8));
    CHECK(input(context, 1, &indices, i_dims, 8));
    char text[300];
    if (data.rank != 2 || data.dims[1] != p->row_bytes) {
        snprintf(text, sizeof text, "data must be [V, %lld] (K=%lld of packed_type %d)", (long long)p->row_bytes,
                 (long long)p->k, p->type);
        return fail("GatherPacked", text);
    }
    if (indices.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 && indices.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32)
        return fail("GatherPacked", "indices must be int64 or int32");
    int64_t count = 1;
    for (size_t i = 0; i < indices.rank; i++) {
        count *= indices.dims[i];
        o_dims[i] = indices.dims[i];
    }
    o_dims[indices.rank] = p->k;
    OrtValue *out = NULL;
    CHECK(ort->KernelContext_GetOutput(context, 0, o_dims, indices.rank + 1, &out));
    float *y = NULL;
    CHECK(ort->GetTensorMutableData(out, (void **)&y));
    const int64_t rows = data.dims[0];
    for (int64_t i = 0; i < count; i++) {
        int64_t index = indices.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 ? ((const int64_t *)indices.data)[i]
                                                                           : ((const int32_t *)indices.data)[i];
        if (index < 0) index += rows;
        if (index < 0 || index >= rows) {
            snprintf(text, sizeof text, "index %lld is out of range for %lld rows", (long long)index, (long long)rows);
            return fail("GatherPacked", text);
        }
        eb_dequantize_row(p->type, (const uint8_t *)data.data + index * p->row_bytes, p->k, y + i * p->k);
    }
    return NULL;
}

/* --- the OrtCustomOp tables --- */

/* A kernel of op `name`: its attributes read into a Packed it owns, or an error status and nothing kept. */
static OrtStatus *create(const char *name, int with_n, const OrtKernelInfo *info, void **kernel) {
    Packed *p = calloc(1, sizeof *p);
    if (p == NULL) return ort->CreateStatus(ORT_FAIL, "ai.edgelm: out of memory");
    OrtStatus *status = read_packed(name, info, with_n, p);
    if (status != NULL) free(p);
    else *kernel = p;
    return status;
}

static OrtStatus *create_matmul(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info, void **kernel) {
    (void)op, (void)api;
    return create("MatMulPacked", 1, info, kernel);
}

static OrtStatus *create_gather(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info, void **kernel) {
    (void)op, (void)api;
    OrtStatus *status = create("GatherPacked", 0, info, kernel);
    int64_t dtype = 1;
    if (status == NULL && attribute(info, "output_dtype", &dtype) && dtype != 1) {
        free(*kernel);
        *kernel = NULL;
        status = fail("GatherPacked", "output_dtype must be 1 (float32)");
    }
    return status;
}

static const char *matmul_name(const OrtCustomOp *op) { (void)op; return "MatMulPacked"; }
static const char *gather_name(const OrtCustomOp *op) { (void)op; return "GatherPacked"; }
static const char *cpu(const OrtCustomOp *op) { (void)op; return "CPUExecutionProvider"; }
static size_t two(const OrtCustomOp *op) { (void)op; return 2; }
static size_t one(const OrtCustomOp *op) { (void)op; return 1; }
static ONNXTensorElementDataType matmul_input(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
}
static ONNXTensorElementDataType gather_input(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; /* int64, int32 */
}
static ONNXTensorElementDataType float_output(const OrtCustomOp *op, size_t i) {
    (void)op, (void)i;
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
static OrtCustomOpInputOutputCharacteristic required(const OrtCustomOp *op, size_t i) {
    (void)op, (void)i;
    return INPUT_OUTPUT_REQUIRED;
}
static OrtMemType default_memory(const OrtCustomOp *op, size_t i) {
    (void)op, (void)i;
    return OrtMemTypeDefault;
}
static int arity(const OrtCustomOp *op) { (void)op; return 1; }
static int homogeneous(const OrtCustomOp *op) { (void)op; return 0; }
static int start_version(const OrtCustomOp *op) { (void)op; return 1; }
static int end_version(const OrtCustomOp *op) { (void)op; return INT_MAX; }
static void destroy(void *kernel) { free(kernel); }

static void fill(OrtCustomOp *op, const char *(*name)(const OrtCustomOp *),
                 ONNXTensorElementDataType (*in_type)(const OrtCustomOp *, size_t),
                 OrtStatus *(*create)(const OrtCustomOp *, const OrtApi *, const OrtKernelInfo *, void **),
                 OrtStatus *(*compute)(void *, OrtKernelContext *)) {
    memset(op, 0, sizeof *op);
    op->version = EB_ORT_API;
    op->GetName = name;
    op->GetExecutionProviderType = cpu;
    op->GetInputType = in_type;
    op->GetInputTypeCount = two;
    op->GetOutputType = float_output;
    op->GetOutputTypeCount = one;
    op->KernelDestroy = destroy;
    op->GetInputCharacteristic = required;
    op->GetOutputCharacteristic = required;
    op->GetInputMemoryType = default_memory;
    op->GetVariadicInputMinArity = arity;
    op->GetVariadicInputHomogeneity = homogeneous;
    op->GetVariadicOutputMinArity = arity;
    op->GetVariadicOutputHomogeneity = homogeneous;
    op->CreateKernelV2 = create;
    op->KernelComputeV2 = compute;
    op->GetStartVersion = start_version;
    op->GetEndVersion = end_version;
}

static OrtCustomOp matmul_op, gather_op;

/* The entry point SessionOptions.register_custom_ops_library calls. */
EB_API OrtStatus *ORT_API_CALL RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base) {
    ort = base->GetApi(EB_ORT_API);
    if (ort == NULL) return NULL; /* an ONNX Runtime older than 1.17: no status API to say so with */
    fill(&matmul_op, matmul_name, matmul_input, create_matmul, matmul_compute);
    fill(&gather_op, gather_name, gather_input, create_gather, gather_compute);
    OrtCustomOpDomain *domain = NULL;
    CHECK(ort->CreateCustomOpDomain("ai.edgelm", &domain));
    CHECK(ort->CustomOpDomain_Add(domain, &matmul_op));
    CHECK(ort->CustomOpDomain_Add(domain, &gather_op));
    return ort->AddCustomOpDomain(options, domain);
}

/* For `edgelm info`: the ISA the kernels run (blocks.h's enum). */
EB_API const char *edgelm_ops_isa(void) { return eb_isa_name(eb_best_isa()); }
