// Build index.js from src/index.ts with the pinned TypeScript (devDependency).
// `--check` compiles to a temp dir and fails if the committed index.js is stale.
import { execFileSync } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const root = join(dirname(fileURLToPath(import.meta.url)), "..");
const tsc = join(root, "node_modules", "typescript", "bin", "tsc");
const check = process.argv.includes("--check");
const outDir = check ? mkdtempSync(join(tmpdir(), "clawbridge-ext-")) : root;
try {
  execFileSync(process.execPath, [tsc, "-p", join(root, "tsconfig.json"), "--outDir", outDir], {
    stdio: "inherit",
  });
  if (check) {
    const fresh = readFileSync(join(outDir, "index.js"), "utf8");
    const committed = readFileSync(join(root, "index.js"), "utf8");
    if (fresh !== committed) {
      console.error("index.js is stale: run `npm run build` in extensions/openclaw");
      process.exit(1);
    }
    console.log("index.js is up to date");
  }
} finally {
  if (check) rmSync(outDir, { recursive: true, force: true });
}
