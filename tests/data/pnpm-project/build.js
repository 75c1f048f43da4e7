'use strict';
const fs = require('fs');
const path = require('path');
const { sumNumbers } = require('./index');

const out = path.join(__dirname, 'dist');
fs.mkdirSync(out, { recursive: true });
fs.writeFileSync(path.join(out, 'result.json'), JSON.stringify({ sum: sumNumbers([1, 2, '3']) }) + '\n');
console.log('fixture build wrote dist/result.json');
