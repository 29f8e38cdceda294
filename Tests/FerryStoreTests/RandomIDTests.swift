@testable import FerryStore
import Foundation
import Testing

/// Outbox event and batch ids: the same text form as `UUID().uuidString.lowercased()`, without a file per id.
@Suite struct RandomIDTests {
    @Test func bitsBecomeAVersion4UUIDText() {
        #expect(RandomID.uuidV4(high: 0, low: 0) == "00000000-0000-4000-8000-000000000000")
        #expect(RandomID.uuidV4(high: .max, low: .max) == "ffffffff-ffff-4fff-bfff-ffffffffffff")
        #expect(
            RandomID.uuidV4(high: 0x0123_4567_89AB_CDEF, low: 0xFEDC_BA98_7654_3210)
                == "01234567-89ab-4def-bedc-ba9876543210")
    }

    /// RFC 9562's layout: 48 bits of Unix milliseconds, version 7, 12 random bits, variant 10, 62 random bits.
    @Test func timeAndBitsBecomeAVersion7UUIDText() {
        #expect(RandomID.uuidV7(unixMillis: 0, high: 0, low: 0) == "00000000-0000-7000-8000-000000000000")
        #expect(RandomID.uuidV7(unixMillis: 0, high: .max, low: .max) == "00000000-0000-7fff-bfff-ffffffffffff")
        // RFC 9562's example time, 2022-02-22 19:22:22 UTC.
        #expect(
            RandomID.uuidV7(unixMillis: 0x017F_22E2_79B0, high: 0xCC3, low: 0x18C4_DC0C_0C07_398F)
                == "017f22e2-79b0-7cc3-98c4-dc0c0c07398f")
        // Only the low 48 bits of the time: a clock before 1970 or past the year 10889 does not trap.
        #expect(RandomID.uuidV7(unixMillis: -1, high: 0, low: 0) == "ffffffff-ffff-7000-8000-000000000000")
        #expect(RandomID.uuidV7(unixMillis: .max, high: 0, low: 0) == "ffffffff-ffff-7000-8000-000000000000")
    }

    /// Later milliseconds sort after earlier ones as text (what the outbox id index sees); within one
    /// millisecond the random bits keep them apart.
    @Test func version7IDsSortByTimeAndDoNotRepeat() {
        let millis: [Int64] = [1_796_000_000_000, 1_796_000_000_001, 1_796_000_000_255, 1_796_000_000_256, 1_900_000_000_000]
        let ids = millis.map { RandomID.uuidV7(unixMillis: $0) }
        #expect(ids == ids.sorted())
        for id in ids {
            let bytes = Array(id.utf8)
            #expect(UUID(uuidString: id)?.uuidString.lowercased() == id)
            #expect(bytes[14] == UInt8(ascii: "7") && "89ab".utf8.contains(bytes[19]), "\(id)")
        }
        let sameMillisecond = (0..<10_000).map { _ in RandomID.uuidV7(unixMillis: 1_796_000_000_000) }
        #expect(Set(sameMillisecond).count == 10_000)
    }

    @Test func randomIDsParseAsUUIDsAndDoNotRepeat() {
        var seen = Set<String>()
        for _ in 0..<10_000 {
            let id = RandomID.uuidV4()
            #expect(id.count == 36 && id == id.lowercased())
            let parsed = UUID(uuidString: id)
            #expect(parsed?.uuidString.lowercased() == id)
            let bytes = Array(id.utf8)
            #expect(bytes[14] == UInt8(ascii: "4") && "89ab".utf8.contains(bytes[19]), "\(id)")
            seen.insert(id)
        }
        #expect(seen.count == 10_000)
    }

    /// The random bytes are drawn from one shared pool: ids made on many threads at once never repeat.
    @Test func idsMadeConcurrentlyDoNotRepeat() async {
        let batches = await withTaskGroup(of: [String].self) { group in
            for _ in 0..<8 { group.addTask { (0..<500).map { _ in RandomID.uuidV4() } } }
            return await group.reduce(into: [[String]]()) { $0.append($1) }
        }
        #expect(Set(batches.joined()).count == 8 * 500)
    }
}
