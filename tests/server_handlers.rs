//! Handler tests through `app(state)` and `oneshot`: no socket. Good requests get SGLang and
//! OpenAI shapes; bad ones get a 4xx in the OpenAI error shape naming the field.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use lockstep::serve::{start_engine, ServeArgs};
use serde_json::{json, Value};
use tower::ServiceExt;

mod common;

fn args(extra: &[&str]) -> ServeArgs {
    let mut flags = vec!["--context-length", "256", "--max-request-bytes", "4096"];
    flags.extend_from_slice(extra);
    common::server::serve_args(&flags)
}

fn router(extra: &[&str]) -> axum::Router {
    common::server::router(&args(extra))
}

async fn call(
    r: &axum::Router,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
) -> (StatusCode, Value) {
    let mut req = Request::builder().method(method).uri(path);
    if body.is_some() {
        req = req.header("content-type", "application/json");
    }
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = r
        .clone()
        .oneshot(
            req.body(body.map_or(Body::empty(), |b| Body::from(b.to_string())))
                .unwrap(),
        )
        .await
        .unwrap();
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
        .await
        .unwrap();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

/// Calls the app and asserts the answer has `status` and an error message containing `needle`.
async fn refused(
    r: &axum::Router,
    method: &str,
    uri: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
    status: StatusCode,
    needle: &str,
) -> Value {
    let (s, v) = call(r, method, uri, body, headers).await;
    assert_eq!(s, status, "{method} {uri}: {v}");
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(needle),
        "{method} {uri}: {v} lacks {needle:?}"
    );
    v
}

/// Dummy weights stand for a checkpoint in the `--quantization` format, as in SGLang: `nvfp4`
/// over the embedded (dummy) model serves what `nvfp4_online` makes of the same drawn weights,
/// token for token and logprob for logprob, and not what BF16 experts give; `fp8` (a block-FP8
/// checkpoint, served in BF16) what BF16 gives.
#[tokio::test]
async fn dummy_weights_serve_the_requested_prequantized_format() {
    let greedy = r#"{"input_ids": [5, 17, 200, 42], "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": true}, "return_logprob": true}"#;
    let generate = |flags: &'static [&'static str]| async move {
        let r = router(flags);
        let (s, v) = call(&r, "POST", "/generate", Some(greedy), &[]).await;
        assert_eq!(s, StatusCode::OK, "{flags:?}: {v}");
        let info = call(&r, "GET", "/server_info", None, &[]).await.1;
        (v, info["recipe"].clone())
    };
    let (nvfp4, recipe) = generate(&["--quantization", "nvfp4"]).await;
    let (online, online_recipe) = generate(&["--quantization", "nvfp4_online"]).await;
    let (bf16, _) = generate(&[]).await;
    let (fp8, _) = generate(&["--quantization", "fp8"]).await;
    assert_eq!(recipe, online_recipe);
    assert_eq!(nvfp4["output_ids"], online["output_ids"]);
    let logprobs = |v: &Value| v["meta_info"]["output_token_logprobs"].clone();
    assert_eq!(logprobs(&nvfp4), logprobs(&online));
    assert_ne!(
        logprobs(&nvfp4),
        logprobs(&bf16),
        "NVFP4 experts change the logprobs"
    );
    assert_eq!(logprobs(&fp8), logprobs(&bf16));
}

#[tokio::test]
async fn generate_answers_in_sglang_shape() {
    let r = router(&[]);
    let (s, v) = call(&r, "POST", "/generate", Some(r#"{"input_ids": [1,2,3], "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": true}, "return_logprob": true, "logprob_start_len": 0, "top_logprobs_num": 2}"#), &[]).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["output_ids"].as_array().unwrap().len(), 4);
    let m = &v["meta_info"];
    assert_eq!(m["finish_reason"], json!({"type": "length", "length": 4}));
    assert_eq!(
        (m["prompt_tokens"].as_u64(), m["completion_tokens"].as_u64()),
        (Some(3), Some(4))
    );
    assert_eq!(m["weight_version"], "default");
    assert_eq!(m["output_token_logprobs"].as_array().unwrap().len(), 4);
    assert_eq!(m["input_token_logprobs"].as_array().unwrap().len(), 3);
    assert!(m["input_token_logprobs"][0][0].is_null());
    assert_eq!(m["output_top_logprobs"][0].as_array().unwrap().len(), 2);

    let (s, v) = call(
        &r,
        "POST",
        "/generate",
        Some(r#"{"text": ["a", "b"], "sampling_params": {"max_new_tokens": 2, "n": 2}}"#),
        &[],
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v.as_array().unwrap().len(), 4, "2 prompts x 2 samples");
}

#[tokio::test]
async fn bad_inputs_get_4xx_naming_the_field() {
    let r = router(&[]);
    let cases: &[(&str, &str, StatusCode, &str)] = &[
        ("/generate", "{not json", StatusCode::BAD_REQUEST, "JSON"),
        (
            "/generate",
            r#"{"sampling_params": {}}"#,
            StatusCode::BAD_REQUEST,
            "text",
        ),
        (
            "/generate",
            r#"{"text": "a", "input_ids": [1]}"#,
            StatusCode::BAD_REQUEST,
            "input_ids",
        ),
        (
            "/generate",
            r#"{"input_ids": []}"#,
            StatusCode::BAD_REQUEST,
            "input_ids",
        ),
        (
            "/generate",
            r#"{"input_ids": [1, 99999]}"#,
            StatusCode::BAD_REQUEST,
            "input_ids",
        ),
        (
            "/generate",
            r#"{"input_ids": [-1]}"#,
            StatusCode::BAD_REQUEST,
            "input_ids",
        ),
        (
            "/generate",
            r#"{"text": "a", "sampling_params": {"temperature": -1}}"#,
            StatusCode::BAD_REQUEST,
            "temperature",
        ),
        (
            "/generate",
            r#"{"text": "a", "sampling_params": {"top_p": 1.5}}"#,
            StatusCode::BAD_REQUEST,
            "top_p",
        ),
        (
            "/generate",
            r#"{"text": "a", "sampling_params": {"temperature": "hot"}}"#,
            StatusCode::BAD_REQUEST,
            "temperature",
        ),
        (
            "/generate",
            r#"{"text": "a", "sampling_params": {"max_new_tokens": 100000}}"#,
            StatusCode::BAD_REQUEST,
            "max_new_tokens",
        ),
        (
            "/generate",
            r#"{"text": "a", "sampling_params": {"n": 1000}}"#,
            StatusCode::BAD_REQUEST,
            "n",
        ),
        (
            "/generate",
            r#"{"text": "a", "return_logprob": true, "top_logprobs_num": 1000}"#,
            StatusCode::BAD_REQUEST,
            "top_logprobs_num",
        ),
        (
            "/generate",
            r#"{"text": "abc", "return_logprob": true, "logprob_start_len": 50}"#,
            StatusCode::BAD_REQUEST,
            "logprob_start_len",
        ),
        (
            "/generate",
            r#"{"text": "a", "return_routed_experts": true}"#,
            StatusCode::BAD_REQUEST,
            "return_routed_experts",
        ),
        (
            "/v1/completions",
            r#"{"model": "x"}"#,
            StatusCode::BAD_REQUEST,
            "prompt",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "a", "max_tokens": "many"}"#,
            StatusCode::BAD_REQUEST,
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            r#"{"messages": []}"#,
            StatusCode::BAD_REQUEST,
            "messages",
        ),
        (
            "/v1/chat/completions",
            r#"{"messages": "hi"}"#,
            StatusCode::BAD_REQUEST,
            "messages",
        ),
    ];
    for (path, body, want, field) in cases {
        let (s, v) = call(&r, "POST", path, Some(body), &[]).await;
        assert_eq!(s, *want, "{path} {body}: {v}");
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(
            msg.contains(field),
            "{path} {body}: message `{msg}` should name `{field}`"
        );
        assert_eq!(v["error"]["code"], json!(want.as_u16()));
        assert!(v["error"]["type"].is_string());
    }
    // Wrong content type, oversize body, unknown endpoint.
    let resp = r
        .clone()
        .oneshot(
            Request::post("/generate")
                .header("content-type", "text/plain")
                .body(Body::from("{}"))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::UNSUPPORTED_MEDIA_TYPE);
    let big = format!(r#"{{"text": "{}"}}"#, "a".repeat(10_000));
    assert_eq!(
        call(&r, "POST", "/generate", Some(&big), &[]).await.0,
        StatusCode::PAYLOAD_TOO_LARGE
    );
    assert_eq!(
        call(&r, "GET", "/nope", None, &[]).await.0,
        StatusCode::NOT_FOUND
    );
    // Unknown fields are ignored.
    let (s, _) = call(&r, "POST", "/generate", Some(r#"{"text": "a", "whatever": 1, "sampling_params": {"max_new_tokens": 1, "frobnicate": true}}"#), &[]).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        call(&r, "GET", "/health", None, &[]).await.0,
        StatusCode::OK
    );
}

#[tokio::test]
async fn keys_guard_generation_and_admin_endpoints() {
    let r = router(&["--api-key", "gen", "--admin-api-key", "adm"]);
    let body = Some(r#"{"text": "a", "sampling_params": {"max_new_tokens": 1}}"#);
    assert_eq!(
        call(&r, "POST", "/generate", body, &[]).await.0,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        call(
            &r,
            "POST",
            "/generate",
            body,
            &[("authorization", "Bearer nope")]
        )
        .await
        .0,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        call(
            &r,
            "POST",
            "/generate",
            body,
            &[("authorization", "Bearer gen")]
        )
        .await
        .0,
        StatusCode::OK
    );
    assert_eq!(
        call(
            &r,
            "POST",
            "/flush_cache",
            None,
            &[("authorization", "Bearer gen")]
        )
        .await
        .0,
        StatusCode::UNAUTHORIZED
    );
    let (s, v) = call(
        &r,
        "POST",
        "/flush_cache",
        None,
        &[("authorization", "Bearer adm")],
    )
    .await;
    assert_eq!((s, &v["success"]), (StatusCode::OK, &json!(true)));
    assert_eq!(
        call(&r, "GET", "/health", None, &[]).await.0,
        StatusCode::OK
    );
}

#[tokio::test]
async fn openai_endpoints_answer_in_openai_shape() {
    let r = router(&[]);
    let (s, v) = call(&r, "POST", "/v1/completions", Some(r#"{"model": "m", "prompt": "hello", "max_tokens": 3, "logprobs": 2, "ignore_eos": true}"#), &[]).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["usage"]["completion_tokens"], 3);
    assert_eq!(v["usage"]["prompt_tokens"], 5);
    assert_eq!(
        v["choices"][0]["logprobs"]["token_logprobs"]
            .as_array()
            .unwrap()
            .len(),
        3
    );
    let (s, v) = call(&r, "POST", "/v1/chat/completions", Some(r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "ignore_eos": true, "n": 2, "seed": 5}"#), &[]).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"].as_array().unwrap().len(), 2);
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["usage"]["completion_tokens"], 4);
    let (s, v) = call(&r, "GET", "/v1/models", None, &[]).await;
    assert_eq!(
        (s, v["data"][0]["id"].as_str()),
        (StatusCode::OK, Some("lockstep-embedded"))
    );
}

/// `/update_weights_from_disk`: only under --weights-root, all or nothing, and afterwards the
/// server computes exactly what a fresh server on the new weights computes.
#[tokio::test]
async fn update_weights_from_disk_is_atomic_and_exact() {
    let src =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/reference/qwen3");
    let tmp = tempfile::tempdir().unwrap();
    // a: the original; b: every weight scaled by 1.5 (same shapes); d: one tensor missing.
    scaled_copy(&src, &tmp.path().join("a"), 1.0);
    scaled_copy(&src, &tmp.path().join("b"), 1.5);
    let mut d = scaled_copy(&src, &tmp.path().join("d"), 1.0);
    d.remove("model.layers.1.mlp.down_proj.weight");
    lockstep::checkpoint::write_file(&tmp.path().join("d/model.safetensors"), &d, None).unwrap();
    let root = tmp.path().to_str().unwrap().to_string();
    let a = tmp.path().join("a");
    let model_a = a.to_str().unwrap().to_string();
    let r = router_on(&model_a, &["--weights-root", &root]);
    let greedy = r#"{"input_ids": [5, 17, 300, 42], "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": true}, "return_logprob": true}"#;
    let before = call(&r, "POST", "/generate", Some(greedy), &[]).await.1;
    let update = |path: String| format!(r#"{{"model_path": "{path}", "weight_version": "v2"}}"#);

    let (s, v) = call(
        &r,
        "POST",
        "/update_weights_from_disk",
        Some(&update("/etc".into())),
        &[],
    )
    .await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{v}");
    refused(
        &r,
        "POST",
        "/update_weights_from_disk",
        Some(&update(tmp.path().join("d").display().to_string())),
        &[],
        StatusCode::BAD_REQUEST,
        "down_proj",
    )
    .await;
    assert_eq!(
        call(&r, "GET", "/get_weight_version", None, &[]).await.1["weight_version"],
        "default"
    );
    assert_eq!(
        call(&r, "POST", "/generate", Some(greedy), &[]).await.1["output_ids"],
        before["output_ids"],
        "a failed update changes nothing"
    );

    let (s, v) = call(
        &r,
        "POST",
        "/update_weights_from_disk",
        Some(&update(tmp.path().join("b").display().to_string())),
        &[],
    )
    .await;
    assert_eq!((s, &v["success"]), (StatusCode::OK, &json!(true)), "{v}");
    assert_eq!(
        call(&r, "GET", "/get_weight_version", None, &[]).await.1["weight_version"],
        "v2"
    );
    let after = call(&r, "POST", "/generate", Some(greedy), &[]).await.1;
    assert_eq!(after["meta_info"]["weight_version"], "v2");
    let fresh = router_on(tmp.path().join("b").to_str().unwrap(), &[]);
    let expected = call(&fresh, "POST", "/generate", Some(greedy), &[]).await.1;
    assert_eq!(after["output_ids"], expected["output_ids"]);
    assert_eq!(
        after["meta_info"]["output_token_logprobs"], expected["meta_info"]["output_token_logprobs"],
        "bitwise the same as a fresh server"
    );
    assert_ne!(
        after["meta_info"]["output_token_logprobs"],
        before["meta_info"]["output_token_logprobs"]
    );

    // Without --weights-root, updates from disk are refused.
    let closed = router_on(&model_a, &[]);
    assert_eq!(
        call(
            &closed,
            "POST",
            "/update_weights_from_disk",
            Some(&update(tmp.path().join("b").display().to_string())),
            &[]
        )
        .await
        .0,
        StatusCode::FORBIDDEN
    );
}

fn router_on(model: &str, extra: &[&str]) -> axum::Router {
    let mut args = vec!["--model-path", model];
    args.extend_from_slice(extra);
    router(&args)
}

/// Writes `dir` = the checkpoint at `src` with every tensor scaled, plus a minimal tokenizer.
fn scaled_copy(
    src: &std::path::Path,
    dir: &std::path::Path,
    scale: f32,
) -> std::collections::BTreeMap<String, lockstep::checkpoint::OwnedTensor> {
    use lockstep::checkpoint::{to_f32, write_file, Checkpoint, OwnedTensor};
    let ckpt = Checkpoint::open(src).unwrap();
    std::fs::create_dir_all(dir).unwrap();
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let mut tensors = std::collections::BTreeMap::new();
    for n in ckpt.names() {
        let t = ckpt.tensor(n).unwrap();
        let v: Vec<f32> = to_f32(n, &t).unwrap().iter().map(|x| x * scale).collect();
        tensors.insert(n.to_string(), OwnedTensor::f32(t.shape().to_vec(), &v));
    }
    write_file(&dir.join("model.safetensors"), &tensors, None).unwrap();
    let tokenizer = r#"{"version": "1.0", "added_tokens": [], "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "hello": 1}, "unk_token": "<unk>"}}"#;
    std::fs::write(dir.join("tokenizer.json"), tokenizer).unwrap();
    tensors
}

async fn put(
    r: &axum::Router,
    session: &str,
    tensors: &[(&String, &lockstep::checkpoint::OwnedTensor)],
) -> (StatusCode, Value) {
    let bytes = safetensors::tensor::serialize(tensors.iter().map(|(n, t)| (n.as_str(), *t)), None)
        .unwrap();
    put_raw(r, session, bytes).await
}

async fn put_raw(r: &axum::Router, session: &str, bytes: Vec<u8>) -> (StatusCode, Value) {
    let req = Request::builder()
        .method("PUT")
        .uri(format!("/update_weights?session={session}"))
        .header("content-type", "application/octet-stream")
        .body(Body::from(bytes))
        .unwrap();
    let resp = r.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let body = axum::body::to_bytes(resp.into_body(), 1 << 20)
        .await
        .unwrap();
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

/// The streamed session: buckets staged and validated on arrival, committed atomically;
/// afterwards the server computes exactly what a fresh server on the new weights computes, and
/// every failure leaves the old weights and version in place.
#[tokio::test]
async fn streamed_weight_update_commits_atomically_and_exactly() {
    let src = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/reference");
    let tmp = tempfile::tempdir().unwrap();
    scaled_copy(&src.join("qwen3_moe"), &tmp.path().join("a"), 1.0);
    let new = scaled_copy(&src.join("qwen3_moe"), &tmp.path().join("b"), 1.25);
    let q = [
        "--quantization",
        "nvfp4_online",
        "--max-staged-weight-bytes",
        "4000000",
    ];
    let r = router_on(tmp.path().join("a").to_str().unwrap(), &q);
    let greedy = r#"{"input_ids": [5, 17, 300, 42], "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": true}, "return_logprob": true}"#;
    let before = call(&r, "POST", "/generate", Some(greedy), &[]).await.1;
    let all: Vec<(&String, &lockstep::checkpoint::OwnedTensor)> = new.iter().collect();

    // Failures: each leaves nothing changed.
    let begin = |v: &str| format!(r#"{{"weight_version": "{v}"}}"#);
    let (s, v) = call(&r, "POST", "/begin_weight_update", Some(&begin("bad")), &[]).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let sid = v["session"].as_str().unwrap().to_string();
    assert_eq!(
        call(
            &r,
            "POST",
            "/begin_weight_update",
            Some(&begin("other")),
            &[]
        )
        .await
        .0,
        StatusCode::CONFLICT,
        "one session at a time"
    );
    let unknown = (
        "model.layers.9.mlp.gate.weight".to_string(),
        new["model.norm.weight"].clone(),
    );
    let (s, v) = put(&r, &sid, &[(&unknown.0, &unknown.1)]).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("model.layers.9.mlp.gate.weight"),
        "{v}"
    );
    let wrong_shape = (
        "model.norm.weight".to_string(),
        new["model.embed_tokens.weight"].clone(),
    );
    let (s, v) = put(&r, &sid, &[(&wrong_shape.0, &wrong_shape.1)]).await;
    assert!(
        s == StatusCode::BAD_REQUEST && v["error"]["message"].as_str().unwrap().contains("shape"),
        "{v}"
    );
    let mut cut =
        safetensors::tensor::serialize(all[..4].iter().map(|(n, t)| (n.as_str(), *t)), None)
            .unwrap();
    cut.truncate(cut.len() - 7);
    assert_eq!(
        put_raw(&r, &sid, cut).await.0,
        StatusCode::BAD_REQUEST,
        "a cut-off body is refused"
    );
    // Only the gate half of an NVFP4 expert: its shared scale cannot be computed.
    let gate = "model.layers.0.mlp.experts.3.gate_proj.weight".to_string();
    assert_eq!(
        put(&r, &sid, &[(&gate, &new[&gate])]).await.0,
        StatusCode::OK
    );
    let (s, v) = call(
        &r,
        "POST",
        "/end_weight_update",
        Some(&format!(r#"{{"session": "{sid}"}}"#)),
        &[],
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("up_proj"),
        "{v}"
    );
    assert_eq!(
        call(&r, "GET", "/get_weight_version", None, &[]).await.1["weight_version"],
        "default"
    );
    assert_eq!(
        call(&r, "POST", "/generate", Some(greedy), &[]).await.1["meta_info"]
            ["output_token_logprobs"],
        before["meta_info"]["output_token_logprobs"]
    );

    // An aborted session changes nothing either.
    let sid = call(
        &r,
        "POST",
        "/begin_weight_update",
        Some(&begin("aborted")),
        &[],
    )
    .await
    .1["session"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(put(&r, &sid, &all[..10]).await.0, StatusCode::OK);
    assert_eq!(
        call(
            &r,
            "POST",
            "/abort_weight_update",
            Some(&format!(r#"{{"session": "{sid}"}}"#)),
            &[]
        )
        .await
        .0,
        StatusCode::OK
    );
    assert_eq!(put(&r, &sid, &all[10..12]).await.0, StatusCode::NOT_FOUND);

    // The real update, in two buckets, with the count checked at commit.
    let sid = call(&r, "POST", "/begin_weight_update", Some(&begin("v3")), &[])
        .await
        .1["session"]
        .as_str()
        .unwrap()
        .to_string();
    let half = all.len() / 2;
    let (s, v) = put(&r, &sid, &all[..half]).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, v) = put(&r, &sid, &all[half..]).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    // Every slot was prepared on arrival: dense weights alone, NVFP4 gate/up halves once both
    // were in (a pair split over the two buckets waits for the second).
    let total: usize = all.iter().map(|(_, t)| t.data.len()).sum();
    assert_eq!(v["waiting_bytes"], 0, "{v}");
    assert_eq!(v["staged_bytes"].as_u64().unwrap() as usize, total, "{v}");
    let end = format!(
        r#"{{"session": "{sid}", "expected_tensors": {}}}"#,
        all.len()
    );
    let (s, v) = call(&r, "POST", "/end_weight_update", Some(&end), &[]).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        call(&r, "GET", "/get_weight_version", None, &[]).await.1["weight_version"],
        "v3"
    );
    let after = call(&r, "POST", "/generate", Some(greedy), &[]).await.1;
    let fresh = router_on(tmp.path().join("b").to_str().unwrap(), &q);
    let expected = call(&fresh, "POST", "/generate", Some(greedy), &[]).await.1;
    assert_eq!(
        after["meta_info"]["output_token_logprobs"], expected["meta_info"]["output_token_logprobs"],
        "bitwise a fresh NVFP4 server on the new weights"
    );
    assert_ne!(
        after["meta_info"]["output_token_logprobs"],
        before["meta_info"]["output_token_logprobs"]
    );
}

/// `--max-staged-weight-bytes` bounds one bucket and the parts that wait for others (an NVFP4
/// gate/up half whose partner has not arrived: the two are quantized with one shared scale),
/// not the whole update: dense weights without a partner, and completed pairs, are prepared on
/// arrival and keep streaming past it. A refused bucket stages nothing; the session stays open.
#[tokio::test]
async fn the_staging_limit_bounds_only_parts_that_wait() {
    let src = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/reference");
    let tmp = tempfile::tempdir().unwrap();
    scaled_copy(&src.join("qwen3_moe"), &tmp.path().join("a"), 1.0);
    let new = scaled_copy(&src.join("qwen3_moe"), &tmp.path().join("b"), 1.25);
    let recipe = lockstep::quant::Recipe::builtin("nvfp4").unwrap();
    let paired = |n: &str| {
        (n.contains("gate_proj") || n.contains("up_proj"))
            && recipe.format_for(n, 3).format == lockstep::quant::Format::Nvfp4
    };
    let limit = 20_000;
    // One tensor per bucket, each under the limit (a bucket's body is bounded by it too).
    let small: Vec<_> = new
        .iter()
        .filter(|(_, t)| t.data.len() + 1024 < limit)
        .collect();
    let whole: Vec<_> = small.iter().filter(|(n, _)| !paired(n)).copied().collect();
    let gates: Vec<_> = small
        .iter()
        .filter(|(n, _)| paired(n) && n.contains("gate_proj"))
        .copied()
        .collect();
    let whole_bytes: usize = whole.iter().map(|(_, t)| t.data.len()).sum();
    assert!(whole_bytes > 4 * limit && gates.len() >= 3, "{whole_bytes}");
    let r = router_on(
        tmp.path().join("a").to_str().unwrap(),
        &[
            "--quantization",
            "nvfp4_online",
            "--max-staged-weight-bytes",
            &limit.to_string(),
        ],
    );
    let v = call(&r, "POST", "/begin_weight_update", Some("{}"), &[])
        .await
        .1;
    let sid = v["session"].as_str().unwrap().to_string();
    for t in &whole {
        let (s, v) = put(&r, &sid, &[*t]).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(v["waiting_bytes"], 0, "{v}");
    }
    // Gate halves without their up halves wait, until the limit refuses one.
    let mut waiting = 0;
    let mut refused = None;
    for (i, t) in gates.iter().enumerate() {
        let (s, v) = put(&r, &sid, &[*t]).await;
        if s != StatusCode::OK {
            refused = Some((i, s, v));
            break;
        }
        waiting += t.1.data.len();
        assert_eq!(
            v["waiting_bytes"].as_u64().unwrap() as usize,
            waiting,
            "{v}"
        );
    }
    let (i, s, v) = refused.expect("the waiting halves pass the limit");
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--max-staged-weight-bytes"),
        "{v}"
    );
    assert!(i > 0, "refused at {i}");
    // The first gate's up half completes the pair: both are prepared and stop waiting.
    let up = gates[0].0.replace("gate_proj", "up_proj");
    let (s, v) = put(&r, &sid, &[(&up, &new[&up])]).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        v["waiting_bytes"].as_u64().unwrap() as usize,
        waiting - gates[0].1.data.len(),
        "{v}"
    );
    assert_eq!(
        v["staged_tensors"],
        whole.len() + i + 1,
        "nothing of the refused bucket: {v}"
    );
    let abort = format!(r#"{{"session": "{sid}"}}"#);
    assert_eq!(
        call(&r, "POST", "/abort_weight_update", Some(&abort), &[])
            .await
            .0,
        StatusCode::OK
    );
}

#[test]
fn impossible_sizes_are_refused_at_start_naming_the_flags() {
    for (flags, named) in [
        (
            &["--max-running-requests", "4096"][..],
            "--chunked-prefill-size",
        ),
        (
            &["--max-total-tokens", "8", "--page-size", "16"][..],
            "--max-total-tokens",
        ),
        (
            &["--max-running-requests", "0"][..],
            "--max-running-requests",
        ),
    ] {
        let err = start_engine(&args(flags))
            .err()
            .expect("refused")
            .to_string();
        assert!(err.contains(named), "{flags:?}: {err}");
    }
}

/// `dir` = the checkpoint at `src` with every tensor scaled and rounded to BF16 (a trainer's
/// dtype), plus the minimal tokenizer of [`scaled_copy`].
fn bf16_copy(
    src: &std::path::Path,
    dir: &std::path::Path,
    scale: f32,
) -> std::collections::BTreeMap<String, lockstep::checkpoint::OwnedTensor> {
    use lockstep::checkpoint::{write_file, OwnedTensor};
    let f32s = scaled_copy(src, dir, scale);
    let tensors: std::collections::BTreeMap<String, OwnedTensor> = f32s
        .iter()
        .map(|(n, t)| {
            let v: Vec<f32> = t
                .data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (n.clone(), OwnedTensor::bf16(t.shape.clone(), &v))
        })
        .collect();
    write_file(&dir.join("model.safetensors"), &tensors, None).unwrap();
    tensors
}

async fn checksum_of(r: &axum::Router) -> Value {
    let (s, v) = call(r, "GET", "/weights_checksum", None, &[]).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["algorithm"], "xxh3_64");
    v
}

/// Streams `tensors` as one session (one bucket) and ends it with `end_extra` fields.
async fn stream_update(
    r: &axum::Router,
    version: &str,
    body: Vec<u8>,
    end_extra: &str,
) -> (StatusCode, Value) {
    let (s, v) = call(
        r,
        "POST",
        "/begin_weight_update",
        Some(&format!(r#"{{"weight_version": "{version}"}}"#)),
        &[],
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let sid = v["session"].as_str().unwrap().to_string();
    let (s, v) = put_raw(r, &sid, body).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let end = format!(r#"{{"session": "{sid}"{end_extra}}}"#);
    call(r, "POST", "/end_weight_update", Some(&end), &[]).await
}

/// The server's checksums are of checkpoint layout: BF16 pushed into an NVFP4 or MXFP8 slot
/// (quantized by the server), the same weights quantized by the client, and a checkpoint made
/// by `lockstep convert` all hash the same, tensor by tensor, and equal the xxh3 of the
/// converted files' own tensors. A wrong checksum at commit changes nothing.
#[tokio::test]
async fn checksums_agree_across_server_quantization_client_quantization_and_convert() {
    use lockstep::checkpoint::Checkpoint;
    use lockstep::push::prepare::{prepare_bucket, PrepareOptions, ServerLayout};
    let src =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/reference/qwen3_moe");
    for (quantization, recipe_name) in [("nvfp4_online", "nvfp4"), ("mxfp8", "mxfp8")] {
        let tmp = tempfile::tempdir().unwrap();
        let (a, b, c) = (
            tmp.path().join("a"),
            tmp.path().join("b"),
            tmp.path().join("c"),
        );
        bf16_copy(&src, &a, 1.0);
        let new = bf16_copy(&src, &b, 1.25);
        let recipe = lockstep::quant::Recipe::builtin(recipe_name).unwrap();
        lockstep::convert::convert(&lockstep::convert::ConvertOptions {
            input: &b,
            output: &c,
            recipe: &recipe,
            max_shard_bytes: 1 << 30,
            progress: false,
        })
        .unwrap();
        let q = ["--quantization", quantization];

        // The converted checkpoint, served as stored.
        let converted = checksum_of(&router_on(c.to_str().unwrap(), &[])).await;
        let ckpt = Checkpoint::open(&c).unwrap();
        let files: serde_json::Map<String, Value> = ckpt
            .names()
            .map(|n| {
                let h = xxhash_rust::xxh3::xxh3_64(ckpt.tensor(n).unwrap().data());
                (n.to_string(), json!(format!("{h:016x}")))
            })
            .collect();
        assert_eq!(
            converted["tensors"].as_object().unwrap(),
            &files,
            "{recipe_name}: the server hashes exactly the converted files' tensors"
        );

        // BF16 pushed, quantized by the server; committed with the converted checksum.
        let r = router_on(a.to_str().unwrap(), &q);
        let before = checksum_of(&r).await;
        assert_ne!(before["overall"], converted["overall"]);
        let all: Vec<(&String, &lockstep::checkpoint::OwnedTensor)> = new.iter().collect();
        let body = safetensors::tensor::serialize(all.iter().map(|(n, t)| (n.as_str(), *t)), None)
            .unwrap();
        let greedy = r#"{"input_ids": [5, 17, 300, 42], "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": true}, "return_logprob": true}"#;
        let out_before = call(&r, "POST", "/generate", Some(greedy), &[]).await.1;

        // A wrong or malformed checksum: 400 naming it, nothing changes.
        for bad in [
            r#", "checksum": "0123456789abcdef""#,
            r#", "checksum": "zz""#,
        ] {
            let (s, v) = stream_update(&r, "wrong", body.clone(), bad).await;
            assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
            assert!(
                v["error"]["message"].as_str().unwrap().contains("checksum"),
                "{v}"
            );
            assert_eq!(
                checksum_of(&r).await,
                before,
                "{recipe_name}: nothing changed"
            );
            assert_eq!(
                call(&r, "POST", "/generate", Some(greedy), &[]).await.1["meta_info"]
                    ["output_token_logprobs"],
                out_before["meta_info"]["output_token_logprobs"]
            );
        }
        let ok = format!(r#", "checksum": {}"#, converted["overall"]);
        let (s, v) = stream_update(&r, "v1", body, &ok).await;
        assert_eq!(s, StatusCode::OK, "{recipe_name}: {v}");
        let pushed = checksum_of(&r).await;
        assert_eq!(pushed["weight_version"], "v1");
        assert_eq!(pushed["tensors"], converted["tensors"], "{recipe_name}");
        assert_eq!(pushed["overall"], converted["overall"]);

        // The same weights quantized by the client (push's own preparation).
        let r2 = router_on(a.to_str().unwrap(), &q);
        let names: Vec<String> = checksum_of(&r2).await["tensors"]
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect();
        let layout = ServerLayout::from_names(&names);
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = new
            .iter()
            .map(|(n, t)| {
                (
                    n.clone(),
                    safetensors::tensor::TensorView::new(t.dtype, t.shape.clone(), &t.data)
                        .unwrap(),
                )
            })
            .collect();
        let members: Vec<(&str, &safetensors::tensor::TensorView<'_>)> =
            views.iter().map(|(n, v)| (n.as_str(), v)).collect();
        let prepared = prepare_bucket(
            &members,
            &PrepareOptions {
                layout: &layout,
                recipe: Some(&recipe),
                quantize_on_client: true,
                source: None,
            },
        )
        .unwrap();
        assert!(
            prepared.tensors > new.len(),
            "quantized slots travel as weight + scales"
        );
        assert_eq!(
            format!(
                "{:016x}",
                before_overlaid(&checksum_of(&r2).await, &prepared.expected)
            ),
            converted["overall"].as_str().unwrap(),
            "the client predicts the server's checksum"
        );
        let (s, v) = stream_update(&r2, "v1", prepared.body.to_vec(), &ok).await;
        assert_eq!(s, StatusCode::OK, "{recipe_name}: {v}");
        assert_eq!(checksum_of(&r2).await["tensors"], converted["tensors"]);
    }
}

/// The overall checksum of a server's `/weights_checksum` with `changed` laid over it.
fn before_overlaid(before: &Value, changed: &lockstep::model::checksum::WeightsChecksum) -> u64 {
    use lockstep::model::checksum::{parse_hex, WeightsChecksum};
    let base = WeightsChecksum {
        tensors: before["tensors"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), parse_hex(v.as_str().unwrap()).unwrap()))
            .collect(),
    };
    base.overlaid(changed).overall()
}

/// The SGLang names gateways and RL frameworks use, with lockstep's real values.
#[tokio::test]
async fn sglang_info_names_and_load_reports() {
    let r = router(&["--enable-return-routed-experts"]);
    for (new, old) in [
        ("/server_info", "/get_server_info"),
        ("/model_info", "/get_model_info"),
    ] {
        let (s1, mut a) = call(&r, "GET", new, None, &[]).await;
        let (s2, mut b) = call(&r, "GET", old, None, &[]).await;
        assert_eq!((s1, s2), (StatusCode::OK, StatusCode::OK));
        a.as_object_mut().unwrap().remove("uptime_s");
        b.as_object_mut().unwrap().remove("uptime_s");
        assert_eq!(a, b, "{new} and {old}");
    }
    let (_, info) = call(&r, "GET", "/server_info", None, &[]).await;
    assert_eq!(info["enable_return_routed_experts"], true, "the flag is on");
    assert_eq!(info["enable_memory_saver"], true);
    assert_eq!(
        info["enable_weights_cpu_backup"], true,
        "the CPU's host weights"
    );
    assert_eq!(info["memory_released"], json!([]));
    assert_eq!(info["weights_state"], "resident");
    assert_eq!(info["num_gpus"], 0, "the CPU backend");
    assert_eq!(info["tp_size"], 1);
    let (_, model) = call(&r, "GET", "/model_info", None, &[]).await;
    let config: Value = serde_json::from_str(lockstep::serve::EMBEDDED_CONFIG).unwrap();
    assert_eq!(model["architectures"], config["architectures"]);
    assert_eq!(model["model_type"], config["model_type"]);

    let (s, load) = call(&r, "GET", "/get_load", None, &[]).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        load,
        json!([{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}])
    );
    let (s, v) = call(&r, "GET", "/v1/loads?include=core", None, &[]).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        v["loads"][0]["max_total_num_tokens"],
        info["max_total_num_tokens"]
    );
    for (q, field) in [
        ("include=core,nope", "include"),
        ("format=yaml", "format"),
        ("dp_rank=one", "dp_rank"),
    ] {
        let (s, v) = call(&r, "GET", &format!("/v1/loads?{q}"), None, &[]).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{q}: {v}");
        assert_eq!(v["error"]["param"], field, "{v}");
    }
    for path in ["/update_weights_from_distributed"] {
        let (s, v) = call(&r, "POST", path, Some("{}"), &[]).await;
        assert_eq!(s, StatusCode::NOT_IMPLEMENTED, "{path}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("not supported"),
            "{v}"
        );
    }
}

/// `/update_weights_from_tensor` (SGLang's CUDA IPC payloads, tests/data/tensor_ipc from
/// scripts/make_tensor_ipc_fixtures.py) on the CPU server: checked like a bucket (a tensor the
/// model lacks or of the wrong shape names it), and a valid payload is a 400 naming
/// `serialized_named_tensors` (no GPU to open the handles on), in SGLang's `{success: false,
/// message}` shape; the weights and version stay.
#[tokio::test]
async fn update_weights_from_tensor_on_the_cpu_server() {
    let r = router(&[]);
    let fixture = |name: &str| {
        let p = format!(
            "{}/tests/data/tensor_ipc/{name}.b64",
            env!("CARGO_MANIFEST_DIR")
        );
        std::fs::read_to_string(p).unwrap().trim().to_string()
    };
    let (_, before) = call(&r, "GET", "/weights_checksum", None, &[]).await;
    let cases = [
        ("direct", None, "serialized_named_tensors", "CPU"),
        (
            "flattened_bucket",
            Some("flattened_bucket"),
            "serialized_named_tensors",
            "CPU",
        ),
        (
            "local_serialized",
            Some("direct"),
            "serialized_named_tensors",
            "CPU",
        ),
        (
            "unknown_name",
            None,
            "model.layers.99.mlp.gate.weight",
            "not a tensor of the served model",
        ),
        ("wrong_shape", None, "model.norm.weight", "shape"),
        ("cpu_tensor", None, "model.norm.weight", "CPU tensor"),
        (
            "forbidden_global",
            None,
            "serialized_named_tensors",
            "not allowed",
        ),
    ];
    for (f, format, param, text) in cases {
        let body = json!({"serialized_named_tensors": [fixture(f)], "load_format": format, "flush_cache": false});
        let (s, v) = call(
            &r,
            "POST",
            "/update_weights_from_tensor",
            Some(&body.to_string()),
            &[],
        )
        .await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{f}: {v}");
        assert_eq!(v["success"], false, "{f}: {v}");
        assert_eq!(v["error"]["param"], param, "{f}: {v}");
        assert!(v["message"].as_str().unwrap().contains(text), "{f}: {v}");
    }
    let body = json!({"serialized_named_tensors": [fixture("direct"), "other"]});
    let (s, v) = call(
        &r,
        "POST",
        "/update_weights_from_tensor",
        Some(&body.to_string()),
        &[],
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert!(v["message"].as_str().unwrap().contains("tp_size 1"), "{v}");
    let (_, after) = call(&r, "GET", "/weights_checksum", None, &[]).await;
    assert_eq!(before, after);
}

/// Miles' bodies: `begin {"selector": "all"}`, buckets without a session id, `end {}`, then
/// `/update_weight_version`; the weights checker sees exactly the pushed tensor change.
#[tokio::test]
async fn sglang_bodies_drive_a_streamed_update_and_the_weights_checker() {
    let src = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/reference");
    let tmp = tempfile::tempdir().unwrap();
    scaled_copy(&src.join("qwen3_moe"), &tmp.path().join("a"), 1.0);
    let new = scaled_copy(&src.join("qwen3_moe"), &tmp.path().join("b"), 1.5);
    let r = router_on(tmp.path().join("a").to_str().unwrap(), &[]);
    let (s, _) = call(
        &r,
        "POST",
        "/weights_checker",
        Some(r#"{"action": "snapshot"}"#),
        &[],
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let (s, v) = call(
        &r,
        "POST",
        "/begin_weight_update",
        Some(r#"{"selector": "all"}"#),
        &[],
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let norm = "model.norm.weight".to_string();
    let req = Request::builder()
        .method("PUT")
        .uri("/update_weights")
        .body(Body::from(
            safetensors::tensor::serialize([(norm.as_str(), &new[&norm])], None).unwrap(),
        ))
        .unwrap();
    assert_eq!(
        r.clone().oneshot(req).await.unwrap().status(),
        StatusCode::OK
    );
    let (s, v) = call(&r, "POST", "/end_weight_update", Some("{}"), &[]).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["weight_version"], "1", "the next after `default`");
    let (s, v) = call(
        &r,
        "POST",
        "/weights_checker",
        Some(r#"{"action": "compare"}"#),
        &[],
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(
        (v["success"].clone(), v["mismatched_tensors"].clone()),
        (json!(false), json!([norm]))
    );

    let (s, v) = call(
        &r,
        "POST",
        "/update_weight_version",
        Some(r#"{"new_version": "step-2"}"#),
        &[],
    )
    .await;
    assert_eq!(
        (s, v["new_version"].clone()),
        (StatusCode::OK, json!("step-2"))
    );
    assert_eq!(
        call(&r, "GET", "/get_weight_version", None, &[]).await.1["weight_version"],
        "step-2"
    );
    let (_, sum) = call(&r, "GET", "/weights_checksum", None, &[]).await;
    let (_, checked) = call(&r, "GET", "/weights_checker", None, &[]).await;
    assert_eq!(sum["weight_version"], "step-2");
    assert_eq!(checked["per_engine_checksum"], sum["overall"]);
    assert_eq!(checked["ranks"][0]["checksums"], sum["tensors"]);

    for (path, body, field) in [
        ("/update_weight_version", "{}", "new_version"),
        ("/end_weight_update", "{}", "session"),
        (
            "/begin_weight_update",
            r#"{"selector": "draft"}"#,
            "selector",
        ),
        ("/weights_checker", r#"{"action": "nope"}"#, "action"),
    ] {
        let (s, v) = call(&r, "POST", path, Some(body), &[]).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{path} {body}: {v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(field),
            "{v}"
        );
    }
}

const GREEDY: &str = r#"{"input_ids": [5, 17, 3, 42, 9], "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": true}, "return_logprob": true, "top_logprobs_num": 2}"#;

/// A greedy run's ids and logprobs (JSON numbers print f32 values exactly, so equal text is
/// equal bits).
async fn greedy_run(r: &axum::Router) -> (Value, Value, Value) {
    let (s, v) = call(r, "POST", "/generate", Some(GREEDY), &[]).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let m = &v["meta_info"];
    assert_eq!(v["output_ids"].as_array().unwrap().len(), 6);
    (
        v["output_ids"].clone(),
        m["output_token_logprobs"].clone(),
        m["output_top_logprobs"].clone(),
    )
}

async fn memory_info(r: &axum::Router) -> (Value, Value) {
    let (_, info) = call(r, "GET", "/server_info", None, &[]).await;
    (
        info["memory_released"].clone(),
        info["weights_state"].clone(),
    )
}

/// SGLang's colocation endpoints on the CPU backend: what each release refuses, serves and
/// frees, and that what comes back after a resume computes the same bits as before.
#[tokio::test]
async fn memory_release_and_resume_follow_sglang() {
    let r = router(&[]);
    let before = greedy_run(&r).await;

    let (s, v) = call(
        &r,
        "POST",
        "/release_memory_occupation",
        Some(r#"{"tags": ["kv_cache"]}"#),
        &[],
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        (&v["success"], &v["tags"]),
        (&json!(true), &json!(["kv_cache"]))
    );
    assert!(
        v["bytes"].as_u64().unwrap() > 0,
        "the KV cache's memory: {v}"
    );
    assert_eq!(
        memory_info(&r).await,
        (json!(["kv_cache"]), json!("resident"))
    );

    // Generation of every kind waits for a resume and says which.
    for (path, body) in [
        ("/generate", GREEDY),
        (
            "/v1/completions",
            r#"{"model": "m", "prompt": "ab", "max_tokens": 2}"#,
        ),
        (
            "/v1/chat/completions",
            r#"{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}"#,
        ),
    ] {
        let (s, v) = call(&r, "POST", path, Some(body), &[]).await;
        assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{path}: {v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(
            msg.contains("kv_cache") && msg.contains("/resume_memory_occupation"),
            "{path}: {msg}"
        );
    }
    let (s, v) = call(
        &r,
        "POST",
        "/generate",
        Some(r#"{"text": "ab", "stream": true}"#),
        &[],
    )
    .await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "streamed too: {v}");
    let (s, v) = call(&r, "GET", "/health_generate", None, &[]).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("resume_memory_occupation"));
    assert_eq!(
        call(&r, "GET", "/health", None, &[]).await.0,
        StatusCode::OK,
        "the process is fine"
    );

    // Twice, what is not released, and tags that are not SGLang's: refused, nothing changes.
    for (path, body, status, says) in [
        (
            "/release_memory_occupation",
            r#"{"tags": ["kv_cache"]}"#,
            StatusCode::CONFLICT,
            "already released",
        ),
        (
            "/resume_memory_occupation",
            r#"{"tags": ["weights"]}"#,
            StatusCode::CONFLICT,
            "not released",
        ),
        (
            "/release_memory_occupation",
            r#"{"tags": ["kv"]}"#,
            StatusCode::BAD_REQUEST,
            "`kv` is not one of",
        ),
        (
            "/resume_memory_occupation",
            r#"{"tags": ["kv_cache", "activations"]}"#,
            StatusCode::BAD_REQUEST,
            "activations",
        ),
        (
            "/release_memory_occupation",
            r#"{"tags": "weights"}"#,
            StatusCode::BAD_REQUEST,
            "tags",
        ),
    ] {
        let (s, v) = call(&r, "POST", path, Some(body), &[]).await;
        assert_eq!(s, status, "{path} {body}: {v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(says),
            "{path} {body}: {v}"
        );
        if status == StatusCode::BAD_REQUEST {
            assert_eq!(v["error"]["param"], "tags", "{v}");
        }
    }
    assert_eq!(
        memory_info(&r).await,
        (json!(["kv_cache"]), json!("resident"))
    );

    let (s, v) = call(
        &r,
        "POST",
        "/resume_memory_occupation",
        Some(r#"{"tags": ["kv_cache"]}"#),
        &[],
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["memory_released"], json!([]));
    assert_eq!(
        greedy_run(&r).await,
        before,
        "an empty KV cache, the same bits"
    );

    // GET with no body, as SGLang takes it: every tag (cuda_graph frees nothing here).
    let (s, v) = call(&r, "GET", "/release_memory_occupation", None, &[]).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["tags"], json!(["kv_cache", "weights", "cuda_graph"]));
    assert_eq!(
        memory_info(&r).await,
        (json!(["kv_cache", "weights"]), json!("released"))
    );
    refused(
        &r,
        "POST",
        "/release_memory_occupation",
        Some(r#"{"tags": null}"#),
        &[],
        StatusCode::CONFLICT,
        "everything is already released",
    )
    .await;
    refused(
        &r,
        "POST",
        "/generate",
        Some(GREEDY),
        &[],
        StatusCode::SERVICE_UNAVAILABLE,
        r#"["kv_cache", "weights"]"#,
    )
    .await;
    // Released weights have no memory to take an update: resume them first.
    refused(
        &r,
        "POST",
        "/begin_weight_update",
        Some("{}"),
        &[],
        StatusCode::CONFLICT,
        "resume_memory_occupation",
    )
    .await;

    // verl's order: weights, then the KV cache; the CPU's weights come back bit for bit.
    let (s, v) = call(
        &r,
        "POST",
        "/resume_memory_occupation",
        Some(r#"{"tags": ["weights"]}"#),
        &[],
    )
    .await;
    assert_eq!(
        (s, &v["weights_state"]),
        (StatusCode::OK, &json!("resident")),
        "{v}"
    );
    assert_eq!(
        call(&r, "POST", "/generate", Some(GREEDY), &[]).await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
    let (s, v) = call(
        &r,
        "GET",
        "/resume_memory_occupation",
        Some(r#"{"tags": ["kv_cache", "cuda_graph"]}"#),
        &[],
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(memory_info(&r).await, (json!([]), json!("resident")));
    assert_eq!(greedy_run(&r).await, before);
    assert_eq!(
        call(&r, "GET", "/health_generate", None, &[]).await.0,
        StatusCode::OK
    );
    refused(
        &r,
        "POST",
        "/resume_memory_occupation",
        Some(r#"{"tags": []}"#),
        &[],
        StatusCode::CONFLICT,
        "nothing is released",
    )
    .await;
}

/// SGLang asserts an idle scheduler before releasing; lockstep answers 409 naming the requests
/// in the way (here one held by an in-place pause) and releases once they are gone.
#[tokio::test]
async fn memory_release_waits_for_an_idle_engine() {
    let r = router(&[]);
    let (s, _) = call(
        &r,
        "POST",
        "/pause_generation",
        Some(r#"{"mode": "in_place"}"#),
        &[],
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let body = r#"{"rid": "held-1", "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": true}}"#;
    let held = {
        let r = r.clone();
        tokio::spawn(async move { call(&r, "POST", "/generate", Some(body), &[]).await })
    };
    // Until the handler has submitted it (the engine then admits it before the release).
    loop {
        let (_, info) = call(&r, "GET", "/server_info", None, &[]).await;
        if info["num_queue_reqs"].as_u64().unwrap() + info["num_running_reqs"].as_u64().unwrap() > 0
        {
            break;
        }
        tokio::task::yield_now().await;
    }
    let (s, v) = call(&r, "POST", "/release_memory_occupation", Some("{}"), &[]).await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("held-1") && msg.contains("pause_generation"),
        "{msg}"
    );
    assert_eq!(
        memory_info(&r).await,
        (json!([]), json!("resident")),
        "nothing released"
    );

    let (s, _) = call(&r, "POST", "/continue_generation", None, &[]).await;
    assert_eq!(s, StatusCode::OK);
    let (s, v) = held.await.unwrap();
    assert_eq!(s, StatusCode::OK, "the held request finishes: {v}");
    assert_eq!(v["meta_info"]["finish_reason"]["type"], "length");
    let (s, v) = call(&r, "POST", "/release_memory_occupation", Some("{}"), &[]).await;
    assert_eq!(s, StatusCode::OK, "idle now: {v}");
    let (s, v) = call(&r, "POST", "/resume_memory_occupation", None, &[]).await;
    assert_eq!(s, StatusCode::OK, "{v}");
}
