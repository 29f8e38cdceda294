import FerrySync

/// Counters, gauges and histograms with a renderer for the Prometheus text exposition format (version 0.0.4).
/// Pure: a value the daemon mutates under a lock (`GatewayMetrics`) and the scrape copies and renders. Families
/// render in declaration order and samples sorted by their labels, so the output is deterministic and tests
/// compare it with exact text.
public struct MetricsRegistry: Sendable, Equatable {
    public enum Kind: String, Sendable {
        case counter, gauge, histogram
    }

    /// Label name/value pairs in a fixed order (the order given), compared as such.
    public struct Labels: Hashable, Comparable, Sendable {
        public var pairs: [Pair]
        public struct Pair: Hashable, Sendable {
            public var name: String
            public var value: String
        }

        public init(_ pairs: KeyValuePairs<String, String> = [:]) {
            self.pairs = pairs.map { Pair(name: $0.key, value: $0.value) }
        }

        public static func < (a: Labels, b: Labels) -> Bool {
            for (x, y) in zip(a.pairs, b.pairs) where x != y {
                return x.name != y.name ? x.name < y.name : x.value < y.value
            }
            return a.pairs.count < b.pairs.count
        }
    }

    struct Histogram: Sendable, Equatable {
        /// Per upper bound (same order as the family's `buckets`), not cumulative; the rest is above the last.
        var counts: [UInt64]
        var count: UInt64 = 0
        var sum: Double = 0
    }

    struct Family: Sendable, Equatable {
        let name: String
        let help: String
        let kind: Kind
        let buckets: [Double]
        var values: [Labels: Double] = [:]
        var histograms: [Labels: Histogram] = [:]
    }

    private var families: [Family] = []
    private var index: [String: Int] = [:]

    public init() {}

    /// Adds a family (once; a second declaration of the same name is ignored). `buckets` only for histograms:
    /// upper bounds, ascending; `+Inf` is implicit.
    public mutating func declare(_ name: String, _ kind: Kind, help: String, buckets: [Double] = []) {
        guard index[name] == nil else { return }
        index[name] = families.count
        families.append(Family(name: name, help: help, kind: kind, buckets: buckets.sorted()))
    }

    /// Counter: adds `amount` (negative amounts are ignored: a counter never goes down).
    public mutating func add(_ name: String, _ amount: Double = 1, labels: Labels = Labels()) {
        guard let i = index[name], families[i].kind == .counter, amount >= 0 else { return }
        families[i].values[labels, default: 0] += amount
    }

    /// Gauge: sets the sample.
    public mutating func set(_ name: String, _ value: Double, labels: Labels = Labels()) {
        guard let i = index[name], families[i].kind == .gauge else { return }
        families[i].values[labels] = value
    }

    /// Histogram: counts one observation.
    public mutating func observe(_ name: String, _ value: Double, labels: Labels = Labels()) {
        guard let i = index[name], families[i].kind == .histogram, !value.isNaN else { return }
        let buckets = families[i].buckets
        var h = families[i].histograms[labels] ?? Histogram(counts: Array(repeating: 0, count: buckets.count))
        if let b = buckets.firstIndex(where: { value <= $0 }) { h.counts[b] &+= 1 }
        h.count &+= 1
        h.sum += value
        families[i].histograms[labels] = h
    }

    /// Drops every sample of a family (a gauge rebuilt from the store at each scrape: a peripheral that is gone
    /// must not keep its last value).
    public mutating func clear(_ name: String) {
        guard let i = index[name] else { return }
        families[i].values = [:]
        families[i].histograms = [:]
    }

    /// The current value of a counter or gauge sample (tests, the live view).
    public func value(_ name: String, labels: Labels = Labels()) -> Double? {
        index[name].flatMap { families[$0].values[labels] }
    }

    /// The exposition text: `# HELP`, `# TYPE`, then the samples of each family.
    public func render() -> String {
        var out = ""
        for family in families {
            out += "# HELP \(family.name) \(Self.escapeHelp(family.help))\n"
            out += "# TYPE \(family.name) \(family.kind.rawValue)\n"
            for labels in family.values.keys.sorted() {
                out += "\(family.name)\(Self.text(labels)) \(Self.number(family.values[labels]!))\n"
            }
            for labels in family.histograms.keys.sorted() {
                let h = family.histograms[labels]!
                var cumulative: UInt64 = 0
                for (bound, count) in zip(family.buckets, h.counts) {
                    cumulative &+= count
                    out += "\(family.name)_bucket\(Self.text(labels, le: Self.number(bound))) \(cumulative)\n"
                }
                out += "\(family.name)_bucket\(Self.text(labels, le: "+Inf")) \(h.count)\n"
                out += "\(family.name)_sum\(Self.text(labels)) \(Self.number(h.sum))\n"
                out += "\(family.name)_count\(Self.text(labels)) \(h.count)\n"
            }
        }
        return out
    }

    /// Whole numbers without a fraction (counts read as counts), others in Swift's shortest round-trip form.
    static func number(_ v: Double) -> String {
        if v.isNaN { return "NaN" }
        if v.isInfinite { return v > 0 ? "+Inf" : "-Inf" }
        if v == v.rounded(), abs(v) < 9.0e15 { return String(Int64(v)) }
        return "\(v)"
    }

    static func text(_ labels: Labels, le: String? = nil) -> String {
        var pairs = labels.pairs.map { "\($0.name)=\"\(escapeLabel($0.value))\"" }
        if let le { pairs.append("le=\"\(le)\"") }
        return pairs.isEmpty ? "" : "{" + pairs.joined(separator: ",") + "}"
    }

    /// Label values may hold anything (a peripheral's address today, a name some day): backslash, quote and
    /// newline are escaped as the format requires.
    static func escapeLabel(_ s: String) -> String {
        var out = ""
        for c in s.unicodeScalars {
            switch c {
            case "\\": out += "\\\\"
            case "\"": out += "\\\""
            case "\n": out += "\\n"
            default: out.unicodeScalars.append(c)
            }
        }
        return out
    }

    static func escapeHelp(_ s: String) -> String {
        var out = ""
        for c in s.unicodeScalars {
            switch c {
            case "\\": out += "\\\\"
            case "\n": out += "\\n"
            default: out.unicodeScalars.append(c)
            }
        }
        return out
    }
}
