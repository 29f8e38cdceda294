// libFuzzer entry for what a backend (or an operator's endpoint) controls in the uplink: the Retry-After
// parser (delay-seconds and the three HTTP-date forms), the response classifier with any status, the header
// line splitter, and the loopback check. Built by `scripts/fuzz SECONDS uplink-headers` together with
// UplinkOutcome.swift, UplinkBody.swift and UplinkEndpoint.swift into one module; not part of Package.swift
// (SwiftPM cannot add -sanitize=fuzzer to one product only).
//
// Input layout: bytes 0-7 are the status (Int64, little endian) and bytes 8-15 the clock (seconds since 1970
// as an Int64, any value); the rest is the header text.

@inline(never)
private func violated(_ message: String) -> Never {
    fatalError("uplink header invariant violated: \(message)")
}

private func int64(_ data: UnsafePointer<UInt8>, _ offset: Int) -> Int64 {
    var value: UInt64 = 0
    for index in 0..<8 { value |= UInt64(data[offset + index]) << UInt64(8 * index) }
    return Int64(bitPattern: value)
}

@_cdecl("LLVMFuzzerTestOneInput")
public func uplinkHeadersFuzz(_ data: UnsafePointer<UInt8>, _ size: Int) -> CInt {
    guard size >= 16 else { return 0 }
    let status = Int(truncatingIfNeeded: int64(data, 0))
    let now = Double(int64(data, 8))
    let text = String(decoding: UnsafeBufferPointer(start: data + 16, count: size - 16), as: UTF8.self)

    if let seconds = RetryAfter.seconds(from: text, nowSecondsSince1970: now) {
        guard seconds >= 0, !seconds.isNaN else { violated("Retry-After \(text.debugDescription) → \(seconds)") }
    }
    if let date = HTTPDate.secondsSince1970(text) {
        // Four-digit years only: every parsed date lies within ±10000 years of 1970.
        guard abs(date) < 320_000_000_000 else { violated("HTTP-date \(text.debugDescription) → \(date)") }
    }
    let outcome = UplinkResponseClassifier.classify(
        status: status, retryAfter: text, location: text, detail: text, nowSecondsSince1970: now)
    switch outcome {
    case .completed(let code): guard (200..<300).contains(code) else { violated("completed with \(code)") }
    case .failed(let code, _): guard (400..<500).contains(code) else { violated("failed with \(code)") }
    case .retry(_, let after): if let after, after < 0 || after.isNaN { violated("negative wait \(after)") }
    case .pause: break
    }
    var policy = UplinkRetryPolicy()
    policy.maxRetryAfterSeconds = 3600
    let capped = policy.cappedRetryAfter(RetryAfter.seconds(from: text, nowSecondsSince1970: now))
    guard capped >= 0, capped <= 3600 else { violated("capped Retry-After \(capped)") }
    _ = HTTPHeaderLine(text)
    if UplinkEndpoint.isLoopback(host: text) {
        let name = text.lowercased()
        guard name == "localhost" || name.hasPrefix("127.") || name.contains(":") else {
            violated("\(text.debugDescription) taken for loopback")
        }
    }
    return 0
}
