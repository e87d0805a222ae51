//! Fuzz target: arbitrary bytes as a `recvmsg(MSG_SOCK_DEVMEM)` control buffer.
//!
//! Properties: the parser never panics; the iterator and `summarize` agree (same error, same
//! totals); the tokens of the parsed frags, batched for SO_DEVMEM_DONTNEED, go out in calls
//! within the kernel's limits (128 tokens, 1024 frags) and cover every token exactly once.
#![no_main]

use libfuzzer_sys::fuzz_target;
use shardwire_devmem::cmsg::{CmsgIter, Frag, summarize};
use shardwire_devmem::socket::TokenBatcher;
use shardwire_devmem::{MAX_DONTNEED_FRAGS, MAX_DONTNEED_TOKENS};

fuzz_target!(|data: &[u8]| {
    let summary = summarize(data);
    let mut it = CmsgIter::new(data);
    let (mut frags, mut bytes, mut first_err) = (0usize, 0u64, None);
    let mut batcher = TokenBatcher::new();
    let mut tokens = Vec::new();
    for f in it.by_ref() {
        match f {
            Ok(Frag::Dmabuf { size, token, .. }) => {
                frags += 1;
                bytes += u64::from(size);
                batcher.push(token);
                tokens.push(token);
            }
            Ok(Frag::Linear { .. }) => {}
            Err(e) => first_err = Some(e),
        }
    }
    match summary {
        Ok(s) => {
            assert!(first_err.is_none());
            assert_eq!((s.dmabuf_frags, s.dmabuf_bytes, s.skipped), (frags, bytes, it.skipped()));
        }
        Err(e) => assert_eq!(Some(e), first_err),
    }
    let mut sent = Vec::new();
    let freed = batcher
        .flush_with(|call| {
            assert!(!call.is_empty() && call.len() <= MAX_DONTNEED_TOKENS);
            let n: usize = call.iter().map(|t| t.token_count as usize).sum();
            assert!(n <= MAX_DONTNEED_FRAGS);
            for t in call {
                sent.extend((0..t.token_count).map(|i| t.token_start + i));
            }
            Ok(n)
        })
        .expect("fake syscall frees everything");
    assert_eq!(freed, tokens.len());
    assert_eq!(sent, tokens);
});
