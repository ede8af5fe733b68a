// swift-tools-version:6.0
import PackageDescription

let strict: [SwiftSetting] = [
    .enableUpcomingFeature("ExistentialAny"),
]

let package = Package(
    name: "Vanish",
    products: [
        .executable(name: "vanish", targets: ["vanish"]),
        .library(name: "VanishFS", targets: ["VanishFS"]),
        .library(name: "VanishClient", targets: ["VanishClient"]),
    ],
    dependencies: [
        .package(url: "https://github.com/apple/swift-argument-parser", from: "1.5.0"),
        .package(url: "https://github.com/apple/swift-log", from: "1.16.0"),
        .package(url: "https://github.com/apple/swift-system", from: "1.4.0"),
    ],
    targets: [
        // libfuse3's low-level API and the Linux calls Glibc does not import.
        .systemLibrary(
            name: "CFuse",
            path: "CShims/CFuse",
            pkgConfig: "fuse3",
            providers: [.apt(["libfuse3-dev"])]
        ),
        // The Linux calls and constants Swift's Glibc module does not import,
        // exported from the system headers by C compiled with _GNU_SOURCE.
        .target(
            name: "CLinux",
            path: "CShims/CLinux",
            cSettings: [.define("_GNU_SOURCE")]
        ),
        // The layer between libfuse and /dev/fuse that negotiates what libfuse 3.14
        // does not know (passthrough, parallel dirops, killpriv v2).
        .target(
            name: "CFuseTransport",
            dependencies: ["CFuse", "CLinux"],
            path: "CShims/CFuseTransport",
            cSettings: [.define("_GNU_SOURCE")],
            linkerSettings: [.linkedLibrary("uring")]
        ),
        // Typed wrappers over the Linux system calls the filesystem makes.
        .target(
            name: "LinuxSyscalls",
            dependencies: ["CLinux", .product(name: "SystemPackage", package: "swift-system")],
            swiftSettings: strict
        ),
        // The Swift face of libfuse's session, request and reply API.
        .target(
            name: "FUSEKit",
            dependencies: ["CFuse", "CFuseTransport", "CLinux", "LinuxSyscalls", .product(name: "SystemPackage", package: "swift-system")],
            swiftSettings: strict
        ),
        // Instant delete: the graveyard on the backing filesystem and the reaper that empties it.
        .target(
            name: "VanishGraveyard",
            dependencies: ["CLinux", "LinuxSyscalls", .product(name: "SystemPackage", package: "swift-system")],
            swiftSettings: strict
        ),
        // Change events: the journal request handlers append to and subscribers follow.
        .target(
            name: "VanishEvents",
            dependencies: ["CLinux", "LinuxSyscalls", "VanishClient", .product(name: "SystemPackage", package: "swift-system")],
            swiftSettings: strict
        ),
        // The passthrough filesystem: inode table, fd cache, request handlers.
        .target(
            name: "VanishFS",
            dependencies: [
                "CFuse", "CLinux", "FUSEKit", "LinuxSyscalls", "VanishGraveyard", "VanishEvents", "VanishClient",
                .product(name: "Logging", package: "swift-log"), .product(name: "SystemPackage", package: "swift-system"),
            ],
            swiftSettings: strict
        ),
        // What programs use to talk to a mount's control socket (trash, restore, events).
        .systemLibrary(name: "CXattr", path: "CShims/CXattr"),
        .target(
            name: "VanishClient",
            dependencies: ["CXattr"],
            swiftSettings: strict
        ),
        // The daemon's side of the control socket.
        .target(
            name: "VanishControl",
            dependencies: [
                "CLinux", "FUSEKit", "LinuxSyscalls", "VanishFS", "VanishClient", "VanishEvents", "VanishGraveyard",
                .product(name: "Logging", package: "swift-log"), .product(name: "SystemPackage", package: "swift-system"),
            ],
            swiftSettings: strict
        ),
        .executableTarget(
            name: "vanish",
            dependencies: [
                "CLinux", "VanishFS", "FUSEKit", "LinuxSyscalls", "VanishGraveyard", "VanishClient", "VanishControl", "VanishEvents",
                .product(name: "ArgumentParser", package: "swift-argument-parser"),
                .product(name: "SystemPackage", package: "swift-system"),
                .product(name: "Logging", package: "swift-log"),
            ],
            swiftSettings: strict
        ),
        .target(
            name: "VanishTestSupport",
            dependencies: ["LinuxSyscalls", "CLinux"],
            path: "Tests/VanishTestSupport",
            swiftSettings: strict
        ),
        .testTarget(
            name: "FUSEKitTests",
            dependencies: ["CFuseTransport", "CFuse"],
            swiftSettings: strict
        ),
        .testTarget(
            name: "VanishFSTests",
            dependencies: ["VanishTestSupport", "LinuxSyscalls", "CFuse", "CLinux", "FUSEKit", "VanishFS", "vanish",
                           .product(name: "SystemPackage", package: "swift-system")],
            exclude: ["concurrent_model.py"],
            swiftSettings: strict
        ),
        .testTarget(
            name: "LinuxSyscallsTests",
            dependencies: ["LinuxSyscalls", .product(name: "SystemPackage", package: "swift-system")],
            swiftSettings: strict
        ),
        .testTarget(
            name: "VanishGraveyardTests",
            dependencies: ["VanishTestSupport", "VanishGraveyard", "VanishClient", "CLinux", "vanish"],
            swiftSettings: strict
        ),
        .testTarget(
            name: "VanishEventsTests",
            dependencies: ["VanishTestSupport", "VanishEvents", "VanishClient", "LinuxSyscalls", "vanish"],
            swiftSettings: strict
        ),
        .testTarget(
            name: "VanishClientTests",
            dependencies: ["VanishClient"],
            swiftSettings: strict
        ),
        .testTarget(
            name: "VanishControlTests",
            dependencies: ["VanishControl", "VanishFS", "FUSEKit", "VanishGraveyard", "VanishClient", "LinuxSyscalls",
                           .product(name: "SystemPackage", package: "swift-system")],
            swiftSettings: strict
        ),
        .testTarget(
            name: "VanishCLITests",
            dependencies: ["VanishTestSupport", "vanish"],
            swiftSettings: strict
        ),
    ],
    swiftLanguageModes: [.v6]
)
