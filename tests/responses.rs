//! End-to-end: OpenAI Responses conversations through the gateway, in front of two mock engines that store their
//! responses. A turn that continues a stored response (`previous_response_id`) goes to the endpoint that made it,
//! whatever the policy, and the stored response can be read and deleted through the gateway.
#![allow(clippy::unwrap_used)]

mod common;

use common::{client, get, post, read, Proc};
use http_body_util::Full;
use hyper::{Request, StatusCode};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_stays_with_the_endpoint_that_stored_it() {
    let a = Proc::engine(&["--dp-size", "2"]);
    let b = Proc::engine(&["--dp-size", "2"]);
    // round_robin sends consecutive requests to different endpoints: only the gateway's memory keeps a
    // conversation on its endpoint (anywhere else, the engine does not know the previous response: a 404).
    let gw = Proc::gateway(&[&a, &b], &["--policy", "round_robin"]);
    let c = client();
    let url = format!("{}/v1/responses", gw.url);
    for conversation in 0..3 {
        let mut previous: Option<String> = None;
        let mut home = None;
        for turn in 0..6 {
            let mut body = json!({"model": "m", "input": format!("turn {turn}"), "max_output_tokens": 2,
                                  "instructions": format!("conversation {conversation}")});
            if let Some(id) = &previous {
                body["previous_response_id"] = json!(id);
            }
            // Half the turns streamed: the id then comes in the first event.
            let streamed = turn % 2 == 1;
            if streamed {
                body["stream"] = json!(true);
            }
            let reply = post(&c, &url, &[], &body).await;
            assert_eq!(
                reply.status,
                StatusCode::OK,
                "conversation {conversation} turn {turn}: {}",
                reply.text
            );
            let response = if streamed {
                let last = reply.text.trim_end().rsplit("data: ").next().unwrap();
                serde_json::from_str::<serde_json::Value>(last).unwrap()["response"].clone()
            } else {
                reply.json.clone()
            };
            let endpoint = reply.endpoint.clone().unwrap();
            assert_eq!(
                *home.get_or_insert(endpoint.clone()),
                endpoint,
                "conversation {conversation} turn {turn}"
            );
            if turn > 0 {
                let cached = response["usage"]["input_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap();
                assert!(cached > 0, "the conversation's cache is on its endpoint: {response}");
            }
            previous = Some(response["id"].as_str().unwrap().to_string());
        }
        // The last response is read and deleted at its worker, through the gateway.
        let id = previous.unwrap();
        let stored = get(&c, &format!("{url}/{id}")).await;
        assert_eq!(
            (stored.status, stored.json["id"].as_str()),
            (StatusCode::OK, Some(id.as_str()))
        );
        let delete = Request::delete(format!("{url}/{id}")).body(Full::default()).unwrap();
        let deleted = read(c.request(delete).await.unwrap()).await;
        assert_eq!(deleted.json["deleted"], json!(true), "{}", deleted.text);
        assert_eq!(get(&c, &format!("{url}/{id}")).await.status, StatusCode::NOT_FOUND);
    }
    let unknown = get(&c, &format!("{url}/resp_unknown")).await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND);
    assert!(
        unknown.json["error"]["message"]
            .as_str()
            .unwrap()
            .contains("resp_unknown"),
        "{}",
        unknown.text
    );
}
