import FerryCore
import Foundation
import Testing

/// FerryCore's one JSON writer, civil time and backoff: the outputs other modules promise byte for byte.
@Suite struct JSONWriterTests {
    @Test func writesCompactOrderedEscapedJSON() {
        let value = JSON.object([
            ("z", .string("a\"b\\c\n\r\t\u{01}é")), ("a", .int(-3)), ("list", .array([.bool(true), .null, .double(1.5)])),
            ("nan", .double(.nan)),
        ])
        #expect(value.text == #"{"z":"a\"b\\c\n\r\t\u0001é","a":-3,"list":[true,null,1.5],"nan":null}"#)
        // Whatever the writer produces parses back to the same strings.
        let parsed = try? JSONSerialization.jsonObject(with: Data(value.text.utf8)) as? [String: Any]
        #expect(parsed?["z"] as? String == "a\"b\\c\n\r\t\u{01}é")
    }

    /// Milliseconds, file sizes and pids are written whole from their own integer types: no conversion through
    /// the platform's `Int`, which on a 32-bit build would trap on a timestamp.
    @Test func integersOfEveryWidthAreWrittenWhole() {
        let value = JSON.array([
            .int(Int64(1_796_050_800_123)), .int(Int64.min), .int(Int32(-7)), .int(UInt16(517)), .int(UInt64.max),
        ])
        #expect(value.text == "[1796050800123,-9223372036854775808,-7,517,9223372036854775807]")
    }

    @Test func sixtyFourBitValuesAreQuotedDecimals() {
        var writer = JSONWriter()
        writer.decimal(UInt64.max)
        #expect(writer.text == "\"18446744073709551615\"")
    }
}

@Suite struct CivilTimeTests {
    @Test(arguments: [
        (Int64(0), "1970-01-01T00:00:00.000Z"), (-1, "1969-12-31T23:59:59.999Z"),
        (951_782_400_000, "2000-02-29T00:00:00.000Z"), (1_796_050_800_123, "2026-11-30T15:00:00.123Z"),
        (253_402_300_799_999, "9999-12-31T23:59:59.999Z"),
    ])
    func formatsRFC3339(millis: Int64, expected: String) {
        #expect(CivilTime.rfc3339(millisecondsSince1970: millis) == expected)
    }

    @Test func daysAndCivilDatesRoundTrip() {
        for days in stride(from: Int64(-800_000), through: 800_000, by: 997) {
            let (year, month, day) = CivilTime.civil(fromDays: days)
            #expect(CivilTime.days(fromCivil: year, month: month, day: day) == days)
        }
    }
}

@Suite struct BackoffTests {
    @Test func doublesUpToTheCap() {
        #expect((1...6).map { Backoff.ceiling(base: 0.5, cap: 10, doublings: $0 - 1) } == [0.5, 1, 2, 4, 8, 10])
        #expect(Backoff.ceiling(base: 1, cap: 1e30, doublings: 500) == 0x1p62)  // clamped, finite
        #expect(Backoff.ceiling(base: 1, cap: 100, doublings: -3) == 1)
        #expect(Backoff.ceiling(base: 3, cap: 1e12, doublings: 40, maxDoublings: 30) == 3 * 0x1p30)
    }

    @Test func durationsDoubleExactlyAndNeverOverflow() {
        #expect(Backoff.ceiling(base: .milliseconds(250), cap: .seconds(5), doublings: 3) == .seconds(2))
        #expect(Backoff.ceiling(base: .milliseconds(250), cap: .seconds(5), doublings: 9) == .seconds(5))
        // 30 doublings at most: an hour's base times 2^30 is still a valid Duration.
        #expect(Backoff.ceiling(base: .seconds(3600), cap: .seconds(Int64.max), doublings: 1000) == .seconds(3600) * (1 << 30))
    }
}

@Suite struct DurationSecondsTests {
    @Test func secondsAndWholeSecondsRoundedUp() {
        #expect(Duration.milliseconds(4_600).inSeconds == 4.6)
        #expect(Duration.milliseconds(4_600).wholeSecondsRoundedUp == 5)
        #expect(Duration.seconds(4).wholeSecondsRoundedUp == 4)
        #expect(Duration.milliseconds(-1_500).wholeSecondsRoundedUp == -1)
    }

    @Test func secondsOutsideADurationAreClampedNotATrap() {
        #expect(Duration.secondsClamped(1.5) == .milliseconds(1_500))
        #expect(Duration.secondsClamped(-3) == .zero)
        #expect(Duration.secondsClamped(.nan) == .zero)
        #expect(Duration.secondsClamped(1e300) == Duration.longestWait)
        #expect(Duration.secondsClamped(.infinity) == Duration.longestWait)
    }

    @Test func wholeSecondsOfDurationsBeyondIntAreClampedNotATrap() {
        let huge = Duration.seconds(Int64.max) * 4
        #expect(huge.wholeSecondsRoundedUp == Int.max)
        #expect((Duration.zero - huge).wholeSecondsRoundedUp == Int.min)
    }
}

@Suite struct MonotonicClockTests {
    private struct FixedClock: MonotonicClock {
        var reading: Double
        func now() -> Double { reading }
    }

    @Test func deadlinesAndWhatIsLeftOfThem() {
        let clock = FixedClock(reading: 1_000)
        #expect(clock.deadline(after: .milliseconds(2_500)) == 1_002.5)
        #expect(clock.remaining(until: 1_002.5) == .milliseconds(2_500))
        #expect(clock.remaining(until: 999) == .zero)  // passed: nothing left, never negative
        #expect(clock.remaining(until: 1e300) == Duration.longestWait)
        #expect(clock.seconds(since: 990) == 10)
    }

    @Test func theSystemClockNeverGoesBack() {
        let clock = SystemMonotonicClock()
        var last = clock.now()
        for _ in 0..<1_000 {
            let now = clock.now()
            #expect(now >= last)
            last = now
        }
        // The integer form is the same timeline.
        #expect(abs(Double(monotonicNanoseconds()) / 1e9 - clock.now()) < 1)
    }
}
